"""trainer.spike under real torchrun (2 ranks, gloo), DDP and FSDP: a spike on one rank rolls
both back, at the same step, to the same state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import assert_same_weights
from tests.dist.test_torchrun import torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def test_a_spike_on_one_rank_rolls_both_back_together(tmp_path: Path) -> None:
    proc = torchrun(str(tmp_path), module="tests.dist.spike_fit", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    clean = ranks[0]["clean"]["summary"]["metrics"]["val/loss"]
    assert ranks[0]["clean"]["rollbacks"] == []
    for name in ("ddp", "fsdp"):
        first, second = ranks[0][name], ranks[1][name]
        # rank 1's loss spiked at step 36; the ranks agreed in the next step's vote (the CPU's
        # NaN/inf check carries it): both went back to step 30, skipping 7 batches each
        assert [(r["step"], r["to_step"], r["batches"]) for r in first["rollbacks"]] == \
            [(37, 30, 7)], name
        assert first["rollbacks"] == second["rollbacks"], name  # rank 1's loss in both
        assert first["rollbacks"][0]["loss"] > 100
        assert_same_weights(first["weights"], second["weights"])
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["spike_rollbacks"] == 1
        # 7 of the 60 batches skipped on each rank: near the clean run, not equal
        assert summary["metrics"]["val/loss"] == pytest.approx(clean, rel=0.25), name
        assert "rolled back to step 30" in (tmp_path / name / "train.log").read_text()
