"""The GPU check without a GPU: its script parses and skips in one line, and the cases that can
run on the CPU pass there, so the one run on a lent GPU does not fail on its own code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, offline_env

SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def test_the_script_parses_and_without_cuda_skips_in_one_line(tmp_path: Path) -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the script would run every case")
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(SCRIPT), str(out)], cwd=tmp_path, capture_output=True,
                            text=True, env=offline_env(PYTHON=sys.executable), timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines() == [
        "gpu_check: skipped: CUDA is not available on this machine"]
    usage = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "<out_dir>" in usage.stderr


def test_the_syncs_check_says_why_not_without_cuda() -> None:
    from benchmarks import syncs

    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    assert "CUDA" in syncs.main([])["skipped"]


@pytest.mark.slow
def test_sigterm_then_resume_case_passes_on_the_cpu(tmp_path: Path) -> None:
    """Three real processes: a straight run, one stopped by SIGTERM, its resume; bitwise equal."""
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", str(tmp_path), "--device", "cpu",
         "--only", "sigterm_resume"], cwd=REPO, env=offline_env(), capture_output=True,
        text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["passed"] == ["sigterm_resume"] and not report["failed"]
    case = report["cases"]["sigterm_resume"]
    assert 0 < case["stopped_at"] < case["global_step"] == 30
    assert case["largest_weight_difference"] == 0.0
