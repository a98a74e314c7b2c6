from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import error_report
from trainkit.entry import env


def _env(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainkit.env", *args],
                          capture_output=True, text=True, timeout=120)


def test_report_lists_versions_and_passes_sanity_check() -> None:
    result = _env()
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"torch                      {torch.__version__}" in out or torch.__version__ in out
    for key in ("torchvision", "CUDA (torch build)", "cuDNN", "NCCL", "CUDA available",
                "MPS available", "CPU cores / torch threads", "distributed env"):
        assert key in out
    assert "sanity check" in out and ": ok" in out


def test_report_shows_distributed_variables() -> None:
    import os

    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_PORT="29555")
    result = subprocess.run([sys.executable, "-m", "trainkit.env"], capture_output=True,
                            text=True, timeout=120, env=env)
    assert "MASTER_PORT=29555" in result.stdout


def test_unavailable_device_is_one_line_and_nonzero() -> None:
    if torch.cuda.is_available():
        return
    result = _env("--device", "cuda")
    assert result.returncode == 2
    details, last = error_report(result.stderr)
    assert "CUDA is not available" in last and details[0].startswith("  why no CUDA: ")


def test_report_lists_torchrun_and_slurm_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("SLURM_NODEID", "3")
    seen = env.collect()["distributed_env"]
    assert seen["TORCHELASTIC_RESTART_COUNT"] == "1" and seen["SLURM_NODEID"] == "3"
