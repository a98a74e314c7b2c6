"""A run killed at any moment loses nothing: real processes, real signals, real disk errors."""

from __future__ import annotations

import json
import random
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    REPO,
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

pytestmark = pytest.mark.slow

# Shuffled data, a one-cycle schedule, AdamW and accumulation windows of 2: everything with
# state. 96 steps of 2 batches of 16 (16 steps an epoch: 6 epochs) leave 40+ steps after the
# latest random SIGKILL's moment and end after the latest signal's step (80).
MAX_STEPS = 96
COMMON = ("trainer.max_epochs=40", f"trainer.max_steps={MAX_STEPS}", "data.batch_size=16",
          "trainer.accumulate_grad_batches=2", "trainer.eval_every_n_epochs=40")


def _assert_same_weights(a: Path, b: Path) -> None:
    assert_same_weights(last_checkpoint(a)["model"], last_checkpoint(b)["model"])


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory: pytest.TempPathFactory, mnist_root: Path) -> Path:
    run_dir = tmp_path_factory.mktemp("straight")
    result = run_train(*tiny_run(run_dir, mnist_root, *COMMON))
    assert result.returncode == 0, result.stderr[-2000:]
    return run_dir


def _start(run_dir: Path, mnist_root: Path, *extra: str) -> Started:
    run_dir.mkdir(parents=True, exist_ok=True)
    return start_module("trainkit.train", *tiny_run(run_dir, mnist_root, *COMMON, *extra),
                        out=run_dir.parent / f"{run_dir.name}.out")


def _wait_for_steps(proc: Started, run_dir: Path, lines: int = 1, *,
                    checkpoint: bool = False, timeout: float = 300) -> int:
    """Block until this run (the last start in ``train.log``) has logged ``lines`` step lines
    (one every ``log_every_n_steps``), and with ``checkpoint`` until ``last.pt`` exists too.
    Returns the last step logged. Waiting for what the run wrote, not for a time, keeps the
    moment inside the run however fast or loaded the machine."""
    deadline = time.monotonic() + timeout
    log, last = run_dir / "train.log", run_dir / "checkpoints" / "last.pt"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"training ended (status {proc.returncode}) before it could be stopped")
        text = log.read_text().split("training MnistNet")[-1] if log.is_file() else ""
        steps = [int(step) for step in re.findall(r" step (\d+)/\d+ ", text)]
        if len(steps) >= lines and (last.is_file() or not checkpoint):
            return steps[-1]
        time.sleep(0.02)  # paces the check; the deadline only ends a failing test
    pytest.fail(f"no {lines} step lines logged in time")


@pytest.mark.parametrize(("signum", "extra"), [
    (signal.SIGTERM, ()), (signal.SIGINT, ()), (signal.SIGHUP, ()), (signal.SIGUSR1, ()),
    (signal.SIGTERM, ("checkpoint.async_save=true",)),  # the save runs on a background thread
], ids=["SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGTERM-async"])
def test_signal_saves_stops_and_the_same_command_resumes_bit_exactly(
        tmp_path: Path, mnist_root: Path, straight_run: Path, signum: int,
        extra: tuple[str, ...]) -> None:
    run_dir, marker = tmp_path / "run", tmp_path / "paused"
    # at one of steps 2-80 (of MAX_STEPS), the same every time, where the run waits for it
    logged = 2 * random.Random(signum).randint(1, 40)
    proc = _start(run_dir, mnist_root, *extra, *pause_at(logged, marker))
    wait_for_pause(proc, marker)
    proc.send_signal(signum)
    assert proc.wait(timeout=120) == 75  # EXIT_PREEMPTED
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "preempted"
    stopped_at = summary["global_step"]
    assert logged <= stopped_at < MAX_STEPS
    assert last_checkpoint(run_dir)["global_step"] == stopped_at
    assert signal.Signals(signum).name in (run_dir / "train.log").read_text()

    resumed = run_train(*tiny_run(run_dir, mnist_root, *COMMON, *extra))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"at step {stopped_at}" in resumed.stdout
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    _assert_same_weights(run_dir, straight_run)


def test_sigkill_at_random_moments_leaves_loadable_checkpoints_and_resumes_exactly(
        tmp_path: Path, mnist_root: Path, straight_run: Path) -> None:
    run_dir = tmp_path / "run"
    chance = random.Random(0)
    for attempt in range(3):  # the second attempt writes its checkpoints in the background
        extra = ("checkpoint.async_save=true",) if attempt == 1 else ()
        proc = _start(run_dir, mnist_root, "checkpoint.every_n_steps=1", *extra)
        # after a checkpoint exists and 1-8 step lines (2-16 steps) into this attempt
        _wait_for_steps(proc, run_dir, chance.randint(1, 8), checkpoint=True)
        # then a random moment within the next few steps and saves (40+ steps remain after
        # three attempts: the run cannot end in it)
        time.sleep(chance.uniform(0, 0.05))
        proc.kill()
        proc.wait(timeout=60)
        files = sorted((run_dir / "checkpoints").glob("*.pt"))
        assert files, "no checkpoint written before the kill"
        for path in files:
            state = torch.load(path, map_location="cpu", weights_only=True)
            assert {"model", "optimizer", "global_step"} <= state.keys()
    finished = run_train(*tiny_run(run_dir, mnist_root, *COMMON))  # no save a step to the end
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert "resumed from" in finished.stdout
    _assert_same_weights(run_dir, straight_run)


def test_unreadable_newest_checkpoints_fall_back_to_the_previous_one(
        tmp_path: Path, mnist_root: Path) -> None:
    run_dir = tmp_path / "run"
    short = ("trainer.max_steps=6", "checkpoint.every_n_steps=2")
    assert run_train(*tiny_run(run_dir, mnist_root, *COMMON, *short)).returncode == 0
    ckpts = run_dir / "checkpoints"
    (ckpts / "last.pt").write_bytes((ckpts / "last.pt").read_bytes()[:1000])  # truncated
    (ckpts / "step_000000006.pt").write_bytes(b"not a checkpoint")  # corrupt
    result = run_train(*tiny_run(run_dir, mnist_root, *COMMON, *short))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "skipping unreadable checkpoint" in result.stdout
    assert "step_000000004.pt at step 4" in result.stdout


def _limit_file_size() -> None:
    """In the child: files may not grow past 256 KiB, as on a full disk (EFBIG, not a signal)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))


def test_full_disk_stops_with_one_line_and_keeps_the_previous_checkpoint(
        tmp_path: Path, mnist_root: Path) -> None:
    run_dir = tmp_path / "run"
    common = ("checkpoint.every_n_steps=2", "sched=constant")  # constant LR: may be extended
    assert run_train(*tiny_run(run_dir, mnist_root, "trainer.max_steps=4", *common)
                     ).returncode == 0
    before = (run_dir / "checkpoints" / "last.pt").read_bytes()
    result = subprocess.run(
        [sys.executable, "-m", "trainkit.train",
         *tiny_run(run_dir, mnist_root, "trainer.max_steps=12", *common)],
        cwd=REPO, env=offline_env(), capture_output=True, text=True, timeout=300,
        preexec_fn=_limit_file_size)
    assert result.returncode == 2
    details, last = error_report(result.stderr)
    assert "cannot write a checkpoint" in last, result.stderr
    assert "File too large" in last and "intact" in last
    assert details == [f"  checkpoint folder: {run_dir / 'checkpoints'}"]
    assert "step 6/12" in result.stdout and "step 8/12" not in result.stdout  # no training on
    assert (run_dir / "checkpoints" / "last.pt").read_bytes() == before
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.endswith(".tmp")]
    assert json.loads((run_dir / "summary.json").read_text())["global_step"] == 4


def test_divergence_stops_with_one_line_and_status(tmp_path: Path, mnist_root: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_train(*tiny_run(run_dir, mnist_root, "optim.lr=1e30", "trainer.max_steps=40",
                                 "trainer.nonfinite_patience=3"))
    assert result.returncode == 2
    details, last = error_report(result.stderr)
    assert "NaN/inf for 3 steps in a row" in last, result.stderr
    assert details == ["  no checkpoint was written"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["nonfinite_steps"] == 3
    assert (run_dir / "train.log").read_text().rstrip().endswith(last)  # the log ends with it


def test_a_bug_keeps_its_traceback_and_train_log_keeps_it_too(tmp_path: Path,
                                                              mnist_root: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_train(*tiny_run(run_dir, mnist_root, "trainer.max_steps=4",
                                 "model._target_=tests.helpers.models.BuggyNet"))
    assert result.returncode == 1  # not bad input: Python's own traceback, once
    assert result.stderr.count("Traceback") == 1 and "ZeroDivisionError" in result.stderr
    log = (run_dir / "train.log").read_text()
    assert log.count("Traceback (most recent call last)") == 1, log
    assert log.rstrip().endswith("ZeroDivisionError: integer division or modulo by zero")
