"""The launcher: ``python -m trainkit.launch`` (torchrun underneath) and ``launch(fn)``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, offline_env
from tests.dist.nets import rank_sum
from tests.helpers.fakes import write_fake_mnist
from trainkit.distributed.torchrun import launch, torchrun_command


@pytest.mark.dist
def test_launch_runs_a_function_on_two_joined_processes() -> None:
    handlers = {signum: signal.getsignal(signum) for signum in signal.valid_signals()}
    environment = dict(os.environ)
    # rank_sum all-reduces rank + 1: 1 + 2 on both ranks only if both are in one group.
    assert launch(rank_sum, nprocs=2) == [3.0, 3.0]
    # torch's agent replaced SIGTERM/SIGINT/SIGHUP/SIGQUIT and set TORCHELASTIC_SIGNALS_TO_HANDLE;
    # the caller (a notebook) gets its own back
    assert {signum: signal.getsignal(signum) for signum in signal.valid_signals()} == handlers
    assert dict(os.environ) == environment


@pytest.mark.dist
def test_launch_module_starts_torchrun_with_one_process_on_cpu(tmp_path: Path) -> None:
    root = write_fake_mnist(tmp_path / "data", n_train=128, n_test=64)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "trainkit.launch", "+exp=mnist", f"hydra.run.dir={run_dir}",
         f"data.root={root}", "data.verify=false", "data.download=false",
         "data.batch_size=32", "trainer.max_steps=2", "trainer.device=cpu",
         "trainer.precision=32"],
        cwd=REPO, env=offline_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True,
        timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "torchrun --standalone --nproc-per-node=1" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["global_step"] == 2


def test_launcher_rejects_bad_counts_in_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "trainkit.launch", "--nproc-per-node=0",
                           "--dry-run", "+exp=mnist"], cwd=REPO, env=offline_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "trainkit: the number of processes must be >= 1, got 0"
    assert torchrun_command(["a=1"], nproc=3)[-3:] == ["-m", "trainkit.train", "a=1"]


def _launch_two(tmp_path: Path, *extra: str) -> list[str]:
    """``python -m trainkit.launch`` of a 2-process FlatNet run on fake MNIST into tmp/run."""
    root = write_fake_mnist(tmp_path / "data", n_train=512, n_test=64)
    return [sys.executable, "-m", "trainkit.launch", "--nproc-per-node=2", "+exp=mnist",
            f"hydra.run.dir={tmp_path / 'run'}", f"data.root={root}", "data.verify=false",
            "data.download=false", "data.batch_size=16", "trainer.log_every_n_steps=1",
            "trainer.precision=32", "model._target_=tests.dist.nets.FlatNet", "~model.widths",
            *extra]


@pytest.mark.dist
def test_launch_module_exits_75_when_the_workers_stop_on_a_signal(tmp_path: Path) -> None:
    """torchrun itself exits 1 here; the launcher tells requeue loops the run can resume."""
    run_dir = tmp_path / "run"
    # Rank 1 gets SIGTERM during its 3rd training forward (tests/dist/nets.py).
    proc = subprocess.run(
        _launch_two(tmp_path, "trainer.max_steps=8", "+model.fault=sigterm", "+model.fault_at=3"),
        cwd=REPO, env=offline_env(TRAINKIT_DIST_TIMEOUT_S="60"), capture_output=True, text=True,
        timeout=180)
    assert proc.returncode == 75, proc.stdout[-2000:] + proc.stderr[-2000:]
    # rank 0's own line ends the output, as in one process: no FAILED block, no line of torchrun's
    assert proc.stdout.rstrip().endswith("stopped at step 3; re-run the same command to resume")
    assert "FAILED" not in proc.stderr and "exitcode" not in proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["global_step"] == 3


@pytest.mark.dist
def test_sigterm_to_the_launcher_reaches_the_workers_which_save_and_it_exits_75(
        tmp_path: Path) -> None:
    """A scheduler signals the process it started: the launcher, not the workers."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        _launch_two(tmp_path, "trainer.max_epochs=50"), cwd=REPO,
        env=offline_env(TRAINKIT_DIST_TIMEOUT_S="60"), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    log = run_dir / "train.log"
    deadline = time.monotonic() + 120
    while not (log.is_file() and " step " in log.read_text().split("training ")[-1]):
        assert proc.poll() is None and time.monotonic() < deadline, "no step logged in time"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["world_size"] == 2
    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert last["global_step"] == summary["global_step"] > 0
