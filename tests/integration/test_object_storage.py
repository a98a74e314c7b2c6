"""Run state on S3: real runs of the entry point against moto's S3 server over HTTP.

A checkpoint in the bucket is visible only once its commit record is written; a run stopped or
killed at any moment resumes bitwise from the bucket alone, on a fresh local folder.
"""

from __future__ import annotations

import json
import random
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    Started,
    assert_same_weights,
    error_report,
    last_checkpoint,
    offline_env,
    pause_at,
    run_train,
    start_module,
    tiny_run,
    wait_for_pause,
)
from tests.helpers.s3 import S3, SECRET, s3_environment
from trainkit.checkpoint.remote import UPLOAD_DELAY_ENV, read_committed
from trainkit.core.runtime import Runtime

pytestmark = pytest.mark.slow
CPU = Runtime(torch.device("cpu"))

# 3 epochs of 16 steps, evaluated each epoch (best.json by val/acc), a step record every 4 steps
# of which the newest 2 are kept
COMMON = ("trainer.max_epochs=3", "checkpoint.every_n_steps=4", "checkpoint.keep_last=2",
          "checkpoint.monitor=val/acc")


@pytest.fixture(scope="module")
def s3(moto_s3: S3) -> Iterator[S3]:
    with s3_environment(moto_s3) as server:
        server.bucket("runs")
        yield server


def _command(run_dir: Path, mnist_root: Path, url: str, *extra: str) -> list[str]:
    return tiny_run(run_dir, mnist_root, *COMMON, f"checkpoint.dir={url}", *extra)


def _bucket(s3: S3 | None) -> object:
    """The bucket's filesystem, with no listing cached (``s3``: the server must be running)."""
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.invalidate_cache()
    return fs


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, mnist_root: Path, s3: S3) -> Path:
    run_dir = tmp_path_factory.mktemp("straight")
    result = run_train(*_command(run_dir, mnist_root, "s3://runs/straight"),
                       env=offline_env(**s3.env), fork=True)
    assert result.returncode == 0, result.stderr[-2000:]
    (run_dir / "console.txt").write_text(result.stdout + result.stderr)  # the logs a user sees
    return run_dir


def _weights(url: str) -> dict:
    return read_committed(url)["model"]


def test_keep_last_best_and_no_secret_in_the_bucket_run(straight: Path, s3: S3) -> None:
    fs = _bucket(s3)
    names = sorted(path.rsplit("/", 1)[-1] for path in fs.ls("runs/straight"))
    assert names == ["best.json", "last.json", "objects", "step_000000044.json",
                     "step_000000048.json"]
    records = {name: json.loads(fs.cat(f"runs/straight/{name}")) for name in names
               if name.endswith(".json")}
    # every object a record names, and no other (the rotated ones and their bytes are gone)
    objects = {f"objects/{p.rsplit('/', 1)[-1]}" for p in fs.ls("runs/straight/objects")}
    assert objects == {record["object"] for record in records.values()}
    assert read_committed("s3://runs/straight/last.json")["global_step"] == 48
    # the step of the first highest val/acc of the evaluations the log shows
    evaluations = [(float(acc), -int(step)) for step, acc in re.findall(
        r" step (\d+) val/loss \S+ val/acc (\S+)", (straight / "train.log").read_text())]
    assert len(evaluations) == 3
    best_step = -max(evaluations)[1]
    assert records["best.json"]["global_step"] == best_step
    assert read_committed("s3://runs/straight/best.json")["global_step"] == best_step
    assert not (straight / "checkpoints").exists()  # nothing written locally
    for path in straight.rglob("*"):  # config, train.log, console, summary, tb
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    for path in fs.find("runs/straight"):  # the checkpoints: config, manifest
        assert SECRET.encode() not in fs.cat(path), path


def _start(run_dir: Path, command: list[str], env: dict[str, str]) -> Started:
    run_dir.mkdir(parents=True, exist_ok=True)
    return start_module("trainkit.train", *command, out=run_dir.parent / f"{run_dir.name}.out",
                        env=env)


def _wait_for_step(proc: Started, run_dir: Path, past: int, timeout: float = 300
                   ) -> int:
    """Block until this attempt of the run logs a step after ``past``; returns it."""
    deadline, log = time.monotonic() + timeout, run_dir / "train.log"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"training ended (status {proc.returncode}) before it could be stopped")
        text = log.read_text().split("training MnistNet")[-1] if log.is_file() else ""
        steps = [int(step) for step in re.findall(r" step (\d+)/\d+ ", text)]
        if steps and steps[-1] > past:
            return steps[-1]
        time.sleep(0.05)  # paces the check; the deadline only ends a failing test
    pytest.fail(f"no step after {past} logged in time")


def test_sigterm_then_the_same_command_on_a_fresh_folder_resumes_bitwise_from_the_bucket(
        tmp_path: Path, mnist_root: Path, s3: S3, straight: Path) -> None:
    url, env = "s3://runs/term", offline_env(**s3.env)
    # the run waits at the end of step 12 of 48 for the signal: no race to its last step
    marker = tmp_path / "paused"
    proc = _start(tmp_path / "a", [*_command(tmp_path / "a", mnist_root, url),
                                   *pause_at(12, marker)], env)
    wait_for_pause(proc, marker)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 75  # EXIT_PREEMPTED
    stopped_at = read_committed(f"{url}/last.json")["global_step"]
    assert 10 < stopped_at < 48
    fresh = tmp_path / "b"  # another machine: an empty local folder
    resumed = run_train(*_command(fresh, mnist_root, url), env=env, fork=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {url}/last.json at step {stopped_at}" in resumed.stdout
    assert_same_weights(_weights(f"{url}/last.json"), _weights("s3://runs/straight/last.json"))


def test_sigkills_during_async_uploads_leave_a_loadable_last_and_resume_bitwise(
        tmp_path: Path, mnist_root: Path, s3: S3, straight: Path) -> None:
    url, run_dir = "s3://runs/killed", tmp_path / "run"
    command = _command(run_dir, mnist_root, url, "checkpoint.async_save=true",
                       "checkpoint.every_n_steps=1")
    # each upload waits 0.2 s before its commit record: the writer is nearly always mid-upload
    slow = offline_env(**s3.env, **{UPLOAD_DELAY_ENV: "0.2"})
    chance, step, committed, mid_upload = random.Random(0), 0, [], 0
    for _ in range(8):
        proc = _start(run_dir, command, slow)
        step = _wait_for_step(proc, run_dir, step)
        time.sleep(chance.uniform(0, 0.4))  # within the next uploads
        proc.kill()
        proc.wait(timeout=60)
        state = read_committed(f"{url}/last.json")  # loadable, checked against its record
        assert {"model", "optimizer", "global_step"} <= state.keys()
        committed.append(state["global_step"])
        mid_upload += bool(_uncommitted(url))
    assert committed == sorted(committed) and committed[-1] < 48, committed
    assert mid_upload  # some kills left an upload without its commit record (never resumed)
    finished = run_train(*command, env=offline_env(**s3.env), fork=True)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert f"resumed from {url}" in finished.stdout
    assert_same_weights(_weights(f"{url}/last.json"), _weights("s3://runs/straight/last.json"))


def _uncommitted(url: str) -> list[str]:
    """The objects in the bucket of steps after ``last.json``'s: uploads a kill left without
    their commit record."""
    fs, root = _bucket(None), url.removeprefix("s3://")
    last = json.loads(fs.cat(f"{root}/last.json"))["global_step"]
    return [path for path in fs.ls(f"{root}/objects")
            if int(path.rsplit("/", 1)[-1].split("-")[0]) > last]


@pytest.mark.parametrize(("url", "env", "says"), [
    ("s3://runs/x", {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"},
     "the storage cannot be reached"),
    ("s3://runs/x", {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""},
     "no credentials for s3:// were found: set AWS_ACCESS_KEY_ID"),
    ("gs://runs/x", {}, "needs gcsfs, which is not installed: pip install 'trainkit[gcs]'"),
], ids=["unreachable", "no-credentials", "missing-package"])
def test_bad_storage_is_one_line_exit_2_and_nothing_written(
        tmp_path: Path, mnist_root: Path, s3: S3, url: str, env: dict[str, str],
        says: str) -> None:
    run_dir = tmp_path / "run"
    result = run_train(*_command(run_dir, mnist_root, url), env=offline_env(**{**s3.env, **env}))
    assert result.returncode == 2, result.stderr[-2000:]
    _, last = error_report(result.stderr)
    assert says in last and url in last
    assert not run_dir.exists()


# -- data from the bucket: the same batches as from local files, resumed mid-epoch -------------


def _upload(s3: S3, local: Path, url: str) -> str:
    fs = _bucket(s3)
    for path in local.iterdir():
        fs.put(str(path), f"{url.removeprefix('s3://')}/{path.name}")
    return url


def _tokens(loader: object) -> list:
    return [batch["tokens"] for batch in loader]


def test_tokens_from_the_bucket_are_fetched_once_checked_and_read_as_local_ones(
        tmp_path: Path, s3: S3) -> None:
    from trainkit.config import DataConfig
    from trainkit.core.errors import ConfigError
    from trainkit.data.pipeline import token_loaders
    from trainkit.data.tools.tokenize import tokenize

    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    tokenize([tmp_path / "text.txt"], tmp_path / "corpus")
    url = _upload(s3, tmp_path / "corpus", "s3://runs/corpus")

    def loaders(root: str) -> tuple:
        cfg = DataConfig(name="tokens", root=root, batch_size=4, eval_batch_size=4, seq_len=16)
        return token_loaders(cfg, CPU, seed=3)

    local, remote = loaders(str(tmp_path / "corpus")), loaders(url)
    assert remote[2] == local[2] == 256  # meta.json's vocabulary, read from the bucket
    for ours, theirs in zip(local[:2], remote[:2]):  # training, then evaluation
        assert_same_batches(_pass_tokens(ours), _pass_tokens(theirs))
    remote[0].set_epoch(2, 5)  # resumed after 5 batches: the rest of the same pass
    assert_same_batches(_pass_tokens(local[0])[5:], _tokens(remote[0]))
    copy = remote[0].path
    stamp = copy.stat().st_mtime_ns
    loaders(url)  # the next run: the copy is reused, not fetched again
    assert copy.stat().st_mtime_ns == stamp and copy.parent != tmp_path / "corpus"
    # a train.bin that is not the one meta.json's checksum is for
    fs = _bucket(s3)
    fs.pipe("runs/corpus/train.bin", (tmp_path / "corpus" / "train.bin").read_bytes()[::-1])
    with pytest.raises(ConfigError, match=r"is corrupt \(its SHA-256 differs"):
        loaders(url)


def _pass_tokens(loader: object) -> list:
    loader.set_epoch(2)
    return _tokens(loader)


def assert_same_batches(a: list, b: list) -> None:
    assert len(a) == len(b) > 1
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_shards_from_the_bucket_stream_the_local_batches_and_resume_mid_epoch(
        tmp_path: Path, s3: S3) -> None:
    from tests.image_files import make_folder
    from trainkit.config import DataConfig
    from trainkit.data.__main__ import main as data_main
    from trainkit.data.pipeline import shard_loaders

    make_folder(tmp_path / "images", classes=2, per_class=6, val_per_class=2, sizes=(10, 14))
    assert data_main(["shards", str(tmp_path / "images"), str(tmp_path / "shards"),
                      "--samples-per-shard", "3"]) == 0
    url = _upload(s3, tmp_path / "shards", "s3://runs/shards")

    def loaders(root: str, **keys: object) -> tuple:
        cfg = DataConfig(**{"name": "webdataset", "root": root, "batch_size": 2,
                            "eval_batch_size": 2, "num_workers": 2, "image_size": 8,
                            "shuffle_buffer": 3, **keys})
        return shard_loaders(cfg, CPU, seed=1)

    # a cache smaller than two shards: copies are made and the oldest removed
    local, remote = loaders(str(tmp_path / "shards")), loaders(url, cache_gb=4e-6)
    for epoch in (1, 2):  # the second epoch reads the kept copies (and the store for the rest)
        expected = _pass(local[0], epoch)
        assert _pass(remote[0], epoch) == expected and len(expected) == 6
    assert _pass(remote[0], 2, start=4) == expected[4:]  # resumed after 4 batches
    assert [y.tolist() for _, y in remote[1]] == [y.tolist() for _, y in local[1]]
    copies = list(_shard_cache().glob("*.tar"))
    assert copies and sum(p.stat().st_size for p in copies) <= 4e-6 * 2**30 + max(
        p.stat().st_size for p in copies)


def test_an_image_folder_from_the_bucket_lists_the_local_files_from_its_copy(
        tmp_path: Path, s3: S3) -> None:
    from tests.image_files import make_folder
    from trainkit.data.sources.image_folder import read_image_folder

    make_folder(tmp_path / "images", classes=2, per_class=3, val_per_class=1, sizes=(10, 14))
    _bucket(s3).put(str(tmp_path / "images"), "runs/images", recursive=True)
    local = read_image_folder(tmp_path / "images")
    remote = read_image_folder("s3://runs/images")
    assert remote.classes == local.classes
    for ours, theirs in ((local.train, remote.train), (local.val, remote.val)):
        copy = Path(theirs.files[0]).parents[2]
        assert [Path(f).relative_to(copy) for f in theirs.files] == [
            Path(f).relative_to(tmp_path / "images") for f in ours.files]
        assert theirs.labels == ours.labels
        assert all(Path(f).read_bytes() == (tmp_path / "images" / Path(g).relative_to(
            tmp_path / "images")).read_bytes() for f, g in zip(theirs.files, ours.files))


def _pass(loader: object, epoch: int, start: int = 0) -> list:
    inner = loader.loader
    inner.set_epoch(epoch, start)
    return [(batch.keys, batch.images.sum().item()) for batch in inner]


def _shard_cache() -> Path:
    from trainkit.data.tools.checksums import cache_dir

    return cache_dir() / "remote" / "shards"


# -- training from the bucket through the entry point: the local batches, resumed mid-epoch ----

SIGTERM_AT = "+callbacks.stop._target_=tests.helpers.callbacks.SigtermAt"
# +exp=lm: a 1-layer GPT of width 32 on windows of 16 bytes, 10 steps
TOKENS = ("+exp=lm", "data.seq_len=16", "data.batch_size=8", "data.eval_batch_size=8",
          "model.dim=32", "model.layers=1", "trainer.max_steps=10", "trainer.max_epochs=1",
          "trainer.eval_max_batches=2", "trainer.log_every_n_steps=1", "trainer.precision=32",
          "checkpoint.every_n_steps=1000", "callbacks.sample.length=4")
# data=webdataset: 12 training images of 16 px in shards of 3, batch 4: 3 steps an epoch, 2
# epochs (the SIGTERM at step 4 lands mid-epoch), resnet18
SHARDS = ("+exp=folder", "data=webdataset", "data.image_size=16", "data.batch_size=4",
          "data.eval_batch_size=4", "data.num_workers=1", "trainer.max_epochs=2",
          "trainer.precision=32", "trainer.channels_last=false", "trainer.log_every_n_steps=1",
          "trainer.ema_decay=null")


def _train(run_dir: Path, root: str, s3: S3, *keys: str, status: int = 0) -> None:
    result = run_train(f"hydra.run.dir={run_dir}", f"data.root={root}", *keys,
                       env=offline_env(OMP_NUM_THREADS="1", **s3.env), fork=True)
    assert result.returncode == status, result.stderr[-3000:]


def _losses(run_dir: Path) -> dict[int, float]:
    lines = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {line["step"]: line["train/loss"] for line in lines if "train/loss" in line}


def _from_the_bucket_like_local(tmp_path: Path, s3: S3, local: Path, url: str,
                                keys: tuple[str, ...], cut: int) -> None:
    """A run on the local files; the same run on ``url`` stopped by SIGTERM after step ``cut``
    (mid-epoch) and re-run: the same losses step by step, and bitwise the same weights."""
    _train(tmp_path / "local", str(local), s3, *keys)
    _train(tmp_path / "bucket", url, s3, *keys, SIGTERM_AT, f"+callbacks.stop.step={cut}",
           status=75)
    assert last_checkpoint(tmp_path / "bucket")["global_step"] == cut
    _train(tmp_path / "bucket", url, s3, *keys)
    log = (tmp_path / "bucket" / "train.log").read_text()
    assert re.search(rf"resumed from \S+ at step {cut} \(epoch \d+, batch [1-9]", log), log
    ours, theirs = _losses(tmp_path / "local"), _losses(tmp_path / "bucket")
    assert len(ours) > cut and ours == theirs  # the same batches, before and after the resume
    assert_same_weights(last_checkpoint(tmp_path / "bucket")["model"],
                        last_checkpoint(tmp_path / "local")["model"])


def test_data_tokens_trains_from_the_bucket_as_from_local_files_and_resumes_mid_epoch(
        tmp_path: Path, s3: S3) -> None:
    from trainkit.data.tools.tokenize import tokenize

    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 300)
    tokenize([tmp_path / "text.txt"], tmp_path / "corpus")
    url = _upload(s3, tmp_path / "corpus", "s3://runs/lm-corpus")
    _from_the_bucket_like_local(tmp_path, s3, tmp_path / "corpus", url, TOKENS, cut=4)


def test_data_webdataset_trains_from_the_bucket_as_from_local_shards_and_resumes_mid_epoch(
        tmp_path: Path, s3: S3) -> None:
    from tests.image_files import make_folder
    from trainkit.data.__main__ import main as data_main

    make_folder(tmp_path / "images", classes=2, per_class=6, val_per_class=2, sizes=(12, 16))
    assert data_main(["shards", str(tmp_path / "images"), str(tmp_path / "shards"),
                      "--samples-per-shard", "3"]) == 0
    url = _upload(s3, tmp_path / "shards", "s3://runs/image-shards")
    _from_the_bucket_like_local(tmp_path, s3, tmp_path / "shards", url, SHARDS, cut=4)
