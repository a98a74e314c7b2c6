"""Signals to the whole process group, as `kill -- -PGID`, Ctrl-C in a terminal, a closing SSH
session and schedulers send them: DataLoader workers get them too. Real processes, started in
their own session (``setsid``) and signalled with ``os.killpg``."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
from pathlib import Path

import pytest

from tests.conftest import (
    assert_same_weights,
    last_checkpoint,
    pause_at,
    run_train,
    start_in_own_group,
    tiny_run,
    wait_for_pause,
)

pytestmark = pytest.mark.slow

# The standard path with 2 workers and a random per-sample crop: what the workers draw must
# resume exactly. 2 epochs of 16 batches in windows of 2: 16 steps of a small model; the
# signalled run waits for its signal at a step end (pause_at), so it never races the last step.
WORKERS = ("data.loader=dataloader", "data.num_workers=2", "data.random_crop_padding=2",
           "trainer.max_epochs=2", "trainer.accumulate_grad_batches=2",
           "model._target_=tests.dist.nets.FlatNet", "~model.widths")


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory: pytest.TempPathFactory, mnist_root: Path) -> Path:
    run_dir = tmp_path_factory.mktemp("straight")
    result = run_train(*tiny_run(run_dir, mnist_root, *WORKERS))
    assert result.returncode == 0, result.stderr[-2000:]
    return run_dir


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signal_to_the_group_with_workers_saves_stops_and_resumes_bit_exactly(
        tmp_path: Path, mnist_root: Path, straight_run: Path, signum: int) -> None:
    run_dir = tmp_path / "run"
    # at the end of step 2, 4 or 6 of 16, where the run waits for the signal
    lines = random.Random(signum).randint(1, 3)
    marker = tmp_path / "paused"
    command = [sys.executable, "-m", "trainkit.train",
               *tiny_run(run_dir, mnist_root, *WORKERS, *pause_at(2 * lines, marker))]
    proc = start_in_own_group(command, tmp_path / "out.txt")
    wait_for_pause(proc, marker)
    os.killpg(proc.pid, signum)  # the main process and both workers
    assert proc.wait(timeout=120) == 75, (tmp_path / "out.txt").read_text()[-3000:]
    output = (tmp_path / "out.txt").read_text()
    assert "killed by signal" not in output and "Traceback" not in output, output[-3000:]
    assert output.count(f"received {signal.Signals(signum).name}") == 1, output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "preempted"
    stopped_at = summary["global_step"]
    assert 2 * lines <= stopped_at < 16
    assert [p.name for p in (run_dir / "checkpoints").glob("step_*.pt")] == [
        f"step_{stopped_at:09d}.pt"]  # one checkpoint, for the stop
    assert last_checkpoint(run_dir)["global_step"] == stopped_at

    resumed = run_train(*tiny_run(run_dir, mnist_root, *WORKERS))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"at step {stopped_at}" in resumed.stdout
    assert_same_weights(last_checkpoint(run_dir)["model"], last_checkpoint(straight_run)["model"])


def test_a_signal_during_start_up_ends_with_one_line_and_status_75(
        tmp_path: Path, mnist_root: Path) -> None:
    run_dir = tmp_path / "run"
    # The model sends SIGHUP to its own process group while it is being built: after the data
    # is loaded, before the first step (without trainkit: death by SIGHUP, status 129).
    command = [sys.executable, "-m", "trainkit.train", *tiny_run(
        run_dir, mnist_root, "model._target_=tests.dist.nets.FlatNet", "~model.widths",
        "+model.startup_signal=SIGHUP")]
    proc = start_in_own_group(command, tmp_path / "out.txt")
    assert proc.wait(timeout=120) == 75
    output = (tmp_path / "out.txt").read_text()
    assert output.strip().splitlines()[-1] == (
        "trainkit: stopped by SIGHUP outside the training steps (before the first or after the "
        "last); re-run the same command to start or resume the run"), output[-3000:]
    assert "Traceback" not in output
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
