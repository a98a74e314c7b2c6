"""Benchmarks run end to end in their tiny mode and print well-formed results (speed unchecked)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, offline_env

pytestmark = pytest.mark.slow


def _run(module: str) -> dict:
    result = subprocess.run([sys.executable, "-m", module, "--quick"], cwd=REPO,
                            env=offline_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout[result.stdout.index("{"):])


def test_overhead_quick() -> None:
    result = _run("benchmarks.overhead")
    assert result["loop_steps_per_s"] > 0 and result["trainer_steps_per_s"] > 0
    assert result["ratio"] > 0


def test_mnist_e2e_quick() -> None:
    result = _run("benchmarks.mnist_e2e")
    (run,) = result["runs"]
    assert run["process_s"] > run["train_s"] > 0
    assert 0.0 <= run["val_acc"] <= 1.0


def test_loaders_quick() -> None:
    result = _run("benchmarks.loaders")
    for name in ("mnist", "cifar10"):
        r = result[name]
        assert r["in_memory_samples_per_s"] > 0 and r["per_sample_samples_per_s"] > 0
        assert r["ratio"] == r["in_memory_samples_per_s"] / r["per_sample_samples_per_s"]


def test_gpu_data_quick_runs_or_says_why_not() -> None:
    import torch

    result = _run("benchmarks.gpu_data")
    if torch.cuda.is_available():
        assert result["cifar_steps_per_s_bf16_channels_last"] > 0
    else:
        assert "CUDA" in result["skipped"]
