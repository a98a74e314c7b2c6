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
