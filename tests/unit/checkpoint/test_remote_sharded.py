"""Sharded (DCP) checkpoints on an fsspec URL, in one process on fsspec's memory:// (2 ranks on
S3: tests/dist/test_fsdp_object_storage.py): commit records naming object folders, keep-last and
best, a new trainkit.pt for the same step, uncommitted or damaged folders never loaded."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch

from trainkit.checkpoint import sharded
from trainkit.checkpoint.consolidate import load_full
from trainkit.checkpoint.remote_sharded import RemoteShardedCheckpoints, forget, read_meta
from trainkit.core.errors import TrainkitError
from trainkit.core.objectstore import filesystem

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def save(ckpts: RemoteShardedCheckpoints, step: int, *, best: bool = False) -> None:
    tensors = {"model": {"w": torch.full((3,), float(step))}, "optimizer": {"m": torch.ones(2)}}
    meta = {"format": sharded.FORMAT, "global_step": step, "epoch": 0}
    ckpts.save(tensors, meta, step, best=best)


@pytest.fixture
def url() -> str:
    return f"memory://bucket/{uuid.uuid4().hex[:8]}/checkpoints"


def test_records_name_whole_folders_and_keep_the_newest_and_the_best(url: str) -> None:
    ckpts = RemoteShardedCheckpoints(url, keep_last=2)
    for step in range(1, 5):
        save(ckpts, step, best=step == 2)
    fs, root = filesystem(url, "checkpoint.dir")
    records = {p.rsplit("/", 1)[-1]: json.loads(fs.cat(p)) for p in fs.ls(root, detail=False)
               if p.endswith(".json")}
    assert sorted(records) == ["best.json", "last.json", "step_000000003.json",
                               "step_000000004.json"]
    folders = {p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/objects", detail=False)}
    assert {f"objects/{name}" for name in folders} == {r["object"] for r in records.values()}
    assert [int(name[:9]) for name in sorted(folders)] == [2, 3, 4]  # 1 rotated away
    assert ckpts.candidates()[:2] == [f"{url}/last.json", f"{url}/step_000000004.json"]
    assert load_full(f"{url}/best.json")["model"]["w"].tolist() == [2.0] * 3


def test_a_new_trainkit_file_for_the_same_step_is_committed_under_a_new_name(url: str) -> None:
    ckpts = RemoteShardedCheckpoints(url, keep_last=2)
    save(ckpts, 5)
    ckpts.update_meta({"format": sharded.FORMAT, "global_step": 5, "epoch": 0, "note": 1}, 5,
                      best=True)
    for name in ("last.json", "best.json", "step_000000005.json"):
        meta = read_meta(f"{url}/{name}")
        assert meta["note"] == 1 and meta["_path"] == f"{url}/{name}"
        forget(meta)
    fs, root = filesystem(url, "checkpoint.dir")
    assert sharded.META_FILE not in {p.rsplit("/", 1)[-1] for p in fs.find(f"{root}/objects")}


def test_an_uncommitted_folder_is_never_read_and_a_damaged_one_is_refused(url: str) -> None:
    ckpts = RemoteShardedCheckpoints(url, keep_last=3)
    save(ckpts, 1)
    fs, root = filesystem(url, "checkpoint.dir")
    fs.pipe(f"{root}/objects/000000002-dead/__1_0.distcp", b"a rank's part, no commit")
    assert [c.rsplit("/", 1)[-1] for c in ckpts.candidates()] == [
        "last.json", "step_000000001.json"]
    save(ckpts, 3)
    assert not any("dead" in path for path in fs.find(root))  # the next commit removed it
    record = json.loads(fs.cat(f"{root}/last.json"))
    shard = f"{root}/{record['object']}/__0_0.distcp"
    fs.pipe(shard, fs.cat(shard)[:-10])  # truncated after its commit
    with pytest.raises(TrainkitError, match=f"checkpoint {url}/last.json is incomplete"):
        read_meta(f"{url}/last.json")



def test_an_async_save_returns_before_its_commit_and_commits_its_own_copy(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import torch.distributed as dist

    # a group of one rank, in this process: the async path is taken under a process group only
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        ckpts = RemoteShardedCheckpoints(url, keep_last=2, async_save=True)
        save(ckpts, 1)
        ckpts.wait()  # step 1 committed
        # step 2's commit waits for the test's read: an event, not a delay a loaded machine
        # outlasts
        gate, commit = threading.Event(), ckpts._commit
        monkeypatch.setattr(ckpts, "_commit", lambda *args: gate.wait(60) and commit(*args))
        live = {"model": {"w": torch.full((3,), 2.0)}, "optimizer": {"m": torch.ones(2)}}
        ckpts.save(live, {"format": sharded.FORMAT, "global_step": 2, "epoch": 0}, 2)
        live["model"]["w"].add_(5)  # the loop goes on: the save has its own copy
        meta = read_meta(f"{url}/last.json")
        forget(meta)
        assert meta["global_step"] == 1  # step 2 is not committed yet
        gate.set()
        ckpts.wait()
        assert load_full(f"{url}/last.json")["model"]["w"].tolist() == [2.0] * 3
        assert [c.rsplit("/", 1)[-1] for c in ckpts.candidates()] == [
            "last.json", "step_000000002.json", "step_000000001.json"]
    finally:
        dist.destroy_process_group()
