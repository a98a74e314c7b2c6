"""The launcher: ``python -m trainkit.launch`` (torchrun underneath) and ``launch(fn)``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, offline_env
from tests.dist.nets import rank_sum
from tests.fakes import write_fake_mnist
from trainkit import env
from trainkit.launch import launch, torchrun_command


@pytest.mark.dist
def test_launch_runs_a_function_on_two_joined_processes() -> None:
    # rank_sum all-reduces rank + 1: 1 + 2 on both ranks only if both are in one group.
    assert launch(rank_sum, nprocs=2) == [3.0, 3.0]


@pytest.mark.dist
def test_launch_module_starts_torchrun_with_one_process_on_cpu(tmp_path: Path) -> None:
    root = write_fake_mnist(tmp_path / "data", n_train=128, n_test=64)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "trainkit.launch", "+exp=mnist", f"hydra.run.dir={run_dir}",
         f"data.root={root}", "data.verify=false", "data.download=false",
         "data.batch_size=32", "trainer.max_steps=2", "trainer.device=cpu"],
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


def test_env_report_lists_torchrun_and_slurm_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("SLURM_NODEID", "3")
    seen = env.collect()["distributed_env"]
    assert seen["TORCHELASTIC_RESTART_COUNT"] == "1" and seen["SLURM_NODEID"] == "3"
