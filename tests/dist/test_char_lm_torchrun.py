"""The LM example under real torchrun, 2 processes, gloo: evaluation every 2 steps on 1 batch
per rank feeding best.pt, and a stop asked for by rank 1 alone ending both ranks at its step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, last_checkpoint, offline_env

pytestmark = pytest.mark.dist


def test_rank_1_alone_stops_both_ranks_at_its_step_and_best_is_of_the_step_evaluations(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", "--monitor-interval=0.1", "-m", "tests.dist.char_lm_stop",
               "--run-dir", str(run_dir), "--max-bytes", "60000", "--steps", "12",
               "--batch-size", "8", "--block", "32", "--dim", "32", "--layers", "2",
               "--eval-every", "2", "--eval-batches", "1", "--log-every", "2",
               "--checkpoint-every", "100", "--device", "cpu"]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240,
                          env=offline_env(TRAINKIT_DIST_TIMEOUT_S="60", OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 0 ended at step 5" in proc.stdout and "rank 1 ended at step 5" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["world_size"] == 2
    assert summary["stop_reason"] == "rank 1 asked at step 5"
    assert "stopped at step 5: rank 1 asked at step 5" in (run_dir / "train.log").read_text()
    assert last_checkpoint(run_dir)["global_step"] == 5
    losses = {line["step"]: line["val/loss"] for line in map(
        json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "val/loss" in line}
    assert list(losses) == [2, 4]
    best = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    assert best["global_step"] == min(losses, key=losses.get)
    assert best["trainer"]["best_metric"] == min(losses.values())
    assert proc.stdout.count("sample at step") == 2  # rank 0 alone prints
