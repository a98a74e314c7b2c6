"""Sharded (FSDP, DCP) checkpoints on S3: 2 ranks through real torchrun (gloo) against moto's S3
server over HTTP.

An uninterrupted run (2 epochs of 8 steps, sync saves) is the reference, and keep-last and best
hold in its bucket. One run with async saves, each attempt the same command on an empty local
folder: stopped by SIGTERM mid-epoch, then killed (SIGKILL to torchrun and both ranks) 8 times
while its uploads are in flight, each stop leaving a loadable last.json; it ends bitwise where
the reference did.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import fsspec
import pytest

from tests.conftest import REPO, hear_preemption_signals, offline_env
from tests.dist.test_sharded_checkpoints import (
    STEPS,
    assert_same_checkpoint,
    ok,
    overrides,
    torchrun,
)
from tests.dist.test_torchrun import torchrun_command
from tests.helpers.fakes import write_fake_mnist
from tests.helpers.s3 import S3, s3_environment
from trainkit.checkpoint.consolidate import load_full
from trainkit.checkpoint.remote import UPLOAD_DELAY_ENV

pytestmark = [pytest.mark.dist, pytest.mark.slow]
LAST = 2 * STEPS  # two epochs


@pytest.fixture(scope="module")
def s3(moto_s3: S3) -> Iterator[S3]:
    with s3_environment(moto_s3) as server:
        server.bucket("fsdp")
        yield server


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fake_mnist(tmp_path_factory.mktemp("fsdps3data"), n_train=256, n_test=64)


def _bucket() -> object:
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.invalidate_cache()
    return fs


def _args(run_dir: Path, data_root: Path, url: str, *extra: str) -> list[str]:
    return overrides(run_dir, data_root, f"checkpoint.dir={url}", "checkpoint.monitor=val/acc",
                     "trainer.max_epochs=2", f"trainer.max_steps={LAST}", *extra)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, data_root: Path, s3: S3) -> Path:
    """An uninterrupted 2-rank fsdp run saving to the bucket every 2 steps, keeping 2."""
    run = tmp_path_factory.mktemp("straight") / "run"
    ok(torchrun(*_args(run, data_root, "s3://fsdp/straight"), **s3.env))
    return run


def test_the_bucket_keeps_the_newest_committed_checkpoints_whole(straight: Path, s3: S3) -> None:
    fs = _bucket()
    names = sorted(path.rsplit("/", 1)[-1] for path in fs.ls("fsdp/straight"))
    assert names == ["best.json", "last.json", "objects", "step_000000014.json",
                     "step_000000016.json"]
    records = {name: json.loads(fs.cat(f"fsdp/straight/{name}")) for name in names
               if name.endswith(".json")}
    assert records["last.json"]["global_step"] == LAST
    # best: the step of the first highest val/acc of the two evaluations the log shows
    evaluations = [(float(acc), -int(step)) for step, acc in re.findall(
        r" step (\d+) val/loss \S+ val/acc (\S+)", (straight / "train.log").read_text())]
    assert len(evaluations) == 2
    assert records["best.json"]["global_step"] == -max(evaluations)[1]
    # the rotated objects are gone; each record's object holds every rank's part, as named
    objects = {f"objects/{p.rsplit('/', 1)[-1]}" for p in fs.ls("fsdp/straight/objects")}
    assert objects == {record["object"] for record in records.values()}
    for record in records.values():
        found = {e["name"].rsplit("/", 1)[-1]: e["size"]
                 for e in fs.ls(f"fsdp/straight/{record['object']}", detail=True)}
        assert found == record["files"]
        assert {".metadata", "__0_0.distcp", "__1_0.distcp", record["meta"]} == set(found)
    meta = load_full("s3://fsdp/straight/last.json")
    assert meta["trainer"]["best_metric"] is not None and meta["world_size"] == 2
    assert not (straight / "checkpoints").exists()  # nothing written locally


def test_sigterm_then_8_sigkills_during_async_uploads_each_resume_from_the_bucket_bitwise(
        straight: Path, data_root: Path, s3: S3, tmp_path: Path) -> None:
    """Every attempt runs on an empty local folder (another machine) with the same command: a
    SIGTERM mid-epoch, then 8 SIGKILLs of torchrun and both ranks at random moments while
    uploads are in flight; after each, last.json loads; the last attempt ends bitwise where the
    uninterrupted run did."""
    url = "s3://fsdp/killed"
    (tmp_path / "tmp").mkdir()  # the ranks' staging folders, which a kill leaves behind
    # each step takes 0.3 s or more and each upload waits 0.5 s before its commit (the next
    # save waits for it): a signal sent after a step lands before the epoch's end, nearly
    # always with an upload in flight or uploaded and not yet committed
    env = offline_env(TRAINKIT_DIST_TIMEOUT_S="60", TMPDIR=str(tmp_path / "tmp"),
                      **{UPLOAD_DELAY_ENV: "0.5"}, **s3.env)

    def attempt(n: int) -> list[str]:
        return _args(tmp_path / f"attempt{n}", data_root, url, "checkpoint.async_save=true",
                     "checkpoint.every_n_steps=1", "+model.forward_delay_s=0.3")

    proc, fs = _start(tmp_path / "attempt0", attempt(0), env), _bucket()
    _wait_for_step(proc, tmp_path / "attempt0", 1,
                   ready=lambda: fs.invalidate_cache() or fs.exists("fsdp/killed/last.json"))
    proc.send_signal(signal.SIGTERM)  # torchrun passes it to both ranks
    assert proc.wait(timeout=120) != 0
    stopped_at = load_full(f"{url}/last.json")["global_step"]
    assert 2 <= stopped_at < STEPS  # mid-epoch
    assert f"stopped at step {stopped_at}" in (tmp_path / "attempt0" / "train.log").read_text()

    chance, committed, mid_upload = random.Random(0), [stopped_at], 0
    for n in range(1, 9):
        proc = _start(tmp_path / f"attempt{n}", attempt(n), env)
        # 2 steps past the resumed one: the save of the first is being uploaded
        _wait_for_step(proc, tmp_path / f"attempt{n}", committed[-1] + 1)
        time.sleep(chance.uniform(0, 0.6))
        _kill_all(proc)  # torchrun and both ranks: the machine is gone

        state = load_full(f"{url}/last.json")  # loadable: every rank's part, checked
        assert {"model", "optimizer", "global_step"} <= state.keys()
        committed.append(state["global_step"])
        mid_upload += bool(_uncommitted("fsdp/killed"))
    assert committed == sorted(committed) and committed[-1] < LAST, committed
    assert mid_upload  # some kills left an upload without its commit record (never resumed)
    log = (tmp_path / "attempt1" / "train.log").read_text()
    assert f"resumed from {url}/last.json at step {stopped_at} (epoch 1, batch {stopped_at})" in log
    ok(torchrun(*attempt(9), **s3.env))  # to the end
    assert f"resumed from {url}/last.json at step {committed[-1]}" in (
        tmp_path / "attempt9" / "train.log").read_text()
    assert_same_checkpoint(load_full(f"{url}/last.json"), load_full("s3://fsdp/straight/last.json"))
    # keep-last and best with async saves: the newest 2 step records, and only their objects
    fs = _bucket()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("fsdp/killed")) == [
        "best.json", "last.json", "objects", "step_000000015.json", "step_000000016.json"]
    named = {json.loads(fs.cat(f"fsdp/killed/{n}"))["object"] for n in (
        "best.json", "last.json", "step_000000015.json", "step_000000016.json")}
    assert {f"objects/{p.rsplit('/', 1)[-1]}" for p in fs.ls("fsdp/killed/objects")} == named


def _start(run_dir: Path, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    """torchrun, its output appended to ``torchrun.out`` beside the run folders."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir.parent / "torchrun.out", "ab") as out:
        return subprocess.Popen(torchrun_command(*args), cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, preexec_fn=hear_preemption_signals)


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, past: int,
                   ready: Callable[[], bool] = lambda: True) -> None:
    """Block until this attempt logs a training step after ``past`` and ``ready()``."""
    log, deadline = run_dir / "train.log", time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"training ended (status {proc.returncode}) before it could be killed")
        text = log.read_text().split("training FSDPFlatNet")[-1] if log.is_file() else ""
        steps = [int(step) for step in re.findall(r" step (\d+)/\d+ ", text)]
        if steps and steps[-1] > past and ready():
            return
        time.sleep(0.05)  # paces the check; the deadline only ends a failing test
    _kill_all(proc)
    pytest.fail(f"no step after {past} logged in time")


def _kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every process under it at once (its workers lead sessions of their
    own, so its process group is not enough), then reap it."""
    import psutil

    for each in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            each.kill()
    proc.wait(timeout=60)


def _uncommitted(root: str) -> list[str]:
    """Object folders of steps after last.json's: uploads a kill left without their record."""
    fs = _bucket()
    last = json.loads(fs.cat(f"{root}/last.json"))["global_step"]
    return [path for path in fs.ls(f"{root}/objects")
            if int(path.rsplit("/", 1)[-1].split("-")[0]) > last]
