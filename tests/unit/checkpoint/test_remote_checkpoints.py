"""Checkpoints on an fsspec URL (fsspec's memory:// here; S3 in tests/integration/
test_object_storage.py): commit records, keep-last and best by layout.py's rules, uncommitted
uploads never resumed, the async writer, and the one-line errors for unusable URLs."""

from __future__ import annotations

import json
import uuid

import pytest
import torch

from trainkit.checkpoint.async_writer import AsyncCheckpointWriter
from trainkit.checkpoint.remote import RemoteCheckpoints, read_committed
from trainkit.core.errors import ConfigError, TrainkitError
from trainkit.core.objectstore import filesystem, store_error


def state(step: int) -> dict:
    return {"model": {"w": torch.full((3,), float(step))}, "optimizer": {}, "global_step": step}


@pytest.fixture
def url() -> str:
    return f"memory://bucket/{uuid.uuid4().hex[:8]}/checkpoints"


def names(url: str) -> list[str]:
    fs, root = filesystem(url, "checkpoint.dir")
    return sorted(p.removeprefix(root + "/") for p in fs.find(root))


def test_saves_commit_records_keep_the_newest_and_the_best_and_only_their_objects(
        url: str) -> None:
    ckpts = RemoteCheckpoints(url, keep_last=2)
    for step in range(1, 6):
        ckpts.save(state(step), step, best=step == 2)
    found = names(url)
    assert [n for n in found if not n.startswith("objects/")] == [
        "best.json", "last.json", "step_000000004.json", "step_000000005.json"]
    # steps 4 and 5, and 2 (best's): rotated objects are removed with their records
    assert [n.split("/")[1][:9] for n in found if n.startswith("objects/")] == [
        "000000002", "000000004", "000000005"]
    assert ckpts.candidates() == [f"{url}/{name}" for name in (
        "last.json", "step_000000005.json", "step_000000004.json")]
    assert ckpts.load_latest()["global_step"] == 5
    assert read_committed(f"{url}/best.json")["model"]["w"].tolist() == [2.0] * 3


def test_an_upload_without_its_record_is_never_resumed_and_the_next_save_removes_it(
        url: str) -> None:
    ckpts = RemoteCheckpoints(url, keep_last=3)
    ckpts.save(state(1), 1)
    fs, root = filesystem(url, "checkpoint.dir")
    fs.pipe(f"{root}/objects/000000002-dead.pt", b"half an upload")  # killed before its commit
    assert ckpts.load_latest()["global_step"] == 1
    ckpts.save(state(3), 3)
    assert not any("dead" in name for name in names(url))


def test_a_record_whose_object_differs_is_skipped_for_the_one_before(url: str) -> None:
    ckpts = RemoteCheckpoints(url, keep_last=3)
    ckpts.save(state(1), 1)
    ckpts.save(state(2), 2)
    fs, root = filesystem(url, "checkpoint.dir")
    record = json.loads(fs.cat(f"{root}/last.json"))
    fs.pipe(f"{root}/{record['object']}", fs.cat(f"{root}/{record['object']}")[:100])
    with pytest.raises(TrainkitError, match="is incomplete"):
        read_committed(f"{url}/last.json")
    # last.json and step 2 name the truncated object: step 1 is resumed
    assert ckpts.load_latest()["global_step"] == 1


def test_the_async_writer_uploads_in_the_background_with_the_same_records(url: str) -> None:
    ckpts = RemoteCheckpoints(url, keep_last=1)
    writer = AsyncCheckpointWriter(ckpts)
    live = state(7)
    writer.save(live, 7)
    live["model"]["w"].add_(1)  # the loop goes on: the upload has its own copy
    writer.save(state(8), 8, periodic=False)
    writer.wait()
    assert read_committed(f"{url}/step_000000007.json")["model"]["w"].tolist() == [7.0] * 3
    assert read_committed(f"{url}/last.json")["global_step"] == 8


def test_unusable_urls_are_one_line_naming_what_to_install_or_set() -> None:
    with pytest.raises(ConfigError, match=r"gs:// protocol needs gcsfs, which is not installed: "
                                          r"pip install 'trainkit\[gcs\]'"):
        RemoteCheckpoints("gs://bucket/run")
    with pytest.raises(ConfigError, match="Protocol not known: nope; use a protocol fsspec"):
        RemoteCheckpoints("nope://bucket/run")
    with pytest.raises(TrainkitError, match="does not exist"):
        read_committed("memory://bucket/none/last.json")
    error = type("NoCredentialsError", (Exception,), {})("Unable to locate credentials")
    said = store_error(error, "s3://b/run", "checkpoint.dir")
    assert str(said) == ("checkpoint.dir=s3://b/run: no credentials for s3:// were found: set "
                         "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)")


def test_an_endpoint_that_drops_every_connection_is_tried_once_at_the_first_contact(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check before training makes one request (which aiohttp may send again once on a
    dropped connection), not the packages' retries: s3fs's 5 over botocore's, with backoff,
    10 connections and ~7 s against this endpoint, a minute each where one does not answer."""
    from tests.helpers.s3 import dropping_endpoint

    pytest.importorskip("s3fs")
    reached = r"^checkpoint.dir=s3://b/run: the storage cannot be reached \(.*\): check the network"
    with dropping_endpoint(monkeypatch) as accepted, pytest.raises(TrainkitError, match=reached):
        RemoteCheckpoints("s3://b/run").check_writable()
    assert 1 <= len(accepted) <= 2  # no retries (the time is not asserted: a noisy machine)
