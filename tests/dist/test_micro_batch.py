"""trainer.micro_batch_size=auto under real torchrun (2 ranks, gloo): one rank runs out of
memory, both move to the same micro-batch, and the step is the DDP step of the whole batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.dist.micro_batch_fit import batches
from tests.dist.test_torchrun import torchrun
from tests.unit.loop.test_micro_batch import Fits

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def test_both_ranks_move_to_the_size_one_rank_needs(tmp_path: Path) -> None:
    proc = torchrun(str(tmp_path), module="tests.dist.micro_batch_fit")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert [r["micro_batch_size"] for r in ranks] == [4, 4]
    # rank 1 ran out at 16 and at 8; rank 0 fitted both but stopped where rank 1 did (the vote
    # after each micro-batch) and followed it to 4
    assert ranks[1]["sizes"] == ranks[0]["sizes"] == [16, 8] + [4] * 8
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["micro_batch_size"] == 4 and summary["status"] == "completed"
    # the DDP step of the whole batches: SGD on the mean of both ranks' mean gradients
    reference = Fits(limit=32)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(2):
        x = torch.cat([batches(r)[step][0] for r in (0, 1)])
        y = torch.cat([batches(r)[step][1] for r in (0, 1)])
        F.cross_entropy(reference(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, value in reference.net.state_dict().items():
        for rank in ranks:
            torch.testing.assert_close(rank["weights"][name], value)


EXIT_RUNS = 3  # each ~15 CPU-seconds; every run must leave the group and exit 0


def test_missing_gradients_an_oom_in_one_ranks_step_and_a_clean_exit(tmp_path: Path) -> None:
    """tests/dist/auto_oom_fit.py, which never calls group.shutdown(), EXIT_RUNS times: each
    run exits 0 with the group fit joined left before the interpreter's finalization. Its first
    fit: a layer only rank 0 uses gets the average with rank 1's zeros (the same collectives on
    both ranks); its second: rank 1's out-of-memory in the optimizer step ends both ranks' fit
    with the report, after one step each (nothing retried)."""
    from tests.dist.auto_oom_fit import Branches

    for run in range(EXIT_RUNS):
        out = tmp_path / str(run)
        proc = torchrun(str(out), module="tests.dist.auto_oom_fit")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert [(out / f"exit_rank{r}.txt").read_text() for r in (0, 1)] == ["False"] * 2
    ranks = [torch.load(out / f"rank{r}.pt") for r in (0, 1)]
    for rank in ranks:
        assert rank["error"].startswith("out of memory on cpu at step 0") and rank["steps"] == [1.0]
    reference = Branches(use_extra=True)  # both ranks' mean loss: rank 1's has no extra layer
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(2):
        losses = []
        for r in (0, 1):
            reference.use_extra = r == 0
            x, y = batches(r)[step]
            losses.append(F.cross_entropy(reference(x), y))
        (sum(losses) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, value in reference.state_dict().items():
        for rank in ranks:
            torch.testing.assert_close(rank["weights"][name], value)
