"""A step of your own under real torchrun (2 ranks, gloo, DDP): two models and two optimizers,
accumulation, a model no optimizer holds; stopped and resumed, bitwise the uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import assert_same_weights
from tests.dist.test_torchrun import torchrun
from trainkit import load_checkpoint

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def test_a_two_optimizer_gan_under_ddp_resumes_bitwise(tmp_path: Path) -> None:
    proc = torchrun(str(tmp_path), module="tests.dist.gan_fit", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for rank in ranks:
        # each trained model wrapped once by DDP; the one no optimizer holds is not
        assert rank["seen"] == {"g": "DistributedDataParallel", "d": "DistributedDataParallel",
                                "prior": "Linear"}
        assert rank["stopped"]["summary"]["status"] == "preempted"
        assert rank["stopped"]["summary"]["global_step"] == 5
        assert rank["resumed"]["summary"]["global_step"] == 12
        for name in ("g", "d", "prior"):
            assert_same_weights(rank["full"]["weights"][name], rank["resumed"]["weights"][name])
    for name in ("g", "d"):  # the replicas agree
        assert_same_weights(ranks[0]["full"]["weights"][name], ranks[1]["full"]["weights"][name])
    full = load_checkpoint(tmp_path / "full" / "checkpoints" / "last.pt")
    cut = load_checkpoint(tmp_path / "cut" / "checkpoints" / "last.pt")
    for name in ("g", "d"):
        assert_same_weights(full["models"][name], cut["models"][name])
        for param, state in full["optimizers"][name]["state"].items():
            assert_same_weights(state, cut["optimizers"][name]["state"][param])
    assert full["schedulers"] == cut["schedulers"]
    assert full["precision"] == cut["precision"]
