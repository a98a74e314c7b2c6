"""Issue 60.1: no per-rank decision changes the collectives a step runs.

Each rank used to decide "this step logs" from its own clock, and that decision picks how the
NaN/inf check is read: on the host (one gloo vote) or on the device (an NCCL all-reduce of the
flag, then a gloo vote). Two ranks whose deadlines fell on different steps issued different
collectives: a hang. Here two "ranks" (two fits in this process) with clocks far apart run
behind a vote whose collectives are counted by kind; their sequences must be equal.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from benchmarks.syncs import gpu_path_on_the_cpu
from trainkit import Trainer, TrainerConfig
from trainkit.distributed import group
from trainkit.loop import run as run_module
from trainkit.observe.schedule import LogSchedule

RANK0_LOGS_AFTER = {2, 5, 6}  # steps whose vote carries rank 0's "a time-based log is due"


@pytest.fixture(autouse=True)
def _device_path_on_the_cpu() -> Iterator[None]:
    with gpu_path_on_the_cpu():
        yield


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g))
            for _ in range(n)]


def _collectives(monkeypatch: pytest.MonkeyPatch, clock) -> list[tuple[int, str]]:
    """The collectives of a 10-step fit, as ``(step, kind)``: ``nccl`` for the device's
    all-reduce of the NaN/inf flag (a tensor handed to the vote), ``gloo`` for a CPU vote."""
    calls: list[tuple[int, str]] = []
    trainer = Trainer(TrainerConfig(device="cpu", max_steps=10, log_every_n_steps=4,
                                    log_every_n_seconds=1.0))
    state = trainer.state

    def fake_any_rank(*flags: bool) -> list[bool]:
        calls.append((state.global_step, "gloo"))
        agreed = list(flags)
        if len(agreed) == 5:  # the step vote: rank 0's log decision is what every rank gets
            agreed[4] = state.global_step in RANK0_LOGS_AFTER
        return agreed

    class CountedVote(group.StepVote):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.active = True  # as under torchrun

        def nonfinite(self, local):
            if isinstance(local, torch.Tensor):  # on a GPU: an NCCL all-reduce of the flag
                calls.append((state.global_step, "nccl"))
                return local
            return super().nonfinite(local)

    monkeypatch.setattr(group, "any_rank", fake_any_rank)
    monkeypatch.setattr(group, "StepVote", CountedVote)
    monkeypatch.setattr(run_module, "LogSchedule", functools.partial(LogSchedule, clock=clock))
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(10))
    monkeypatch.undo()
    return calls


def test_ranks_with_different_clocks_issue_the_same_collectives(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter(range(0, 10**6, 100))
    fast = _collectives(monkeypatch, lambda: float(next(ticks)))  # every step past its deadline
    with gpu_path_on_the_cpu():
        slow = _collectives(monkeypatch, lambda: 0.0)  # never a deadline
    assert fast == slow
    kinds = {}
    for step, kind in fast:
        kinds.setdefault(step, []).append(kind)
    # both ways ran: host-read steps (a gloo vote only) and device-checked ones (nccl + gloo)
    assert "nccl" in kinds[0] and "nccl" not in kinds[2]  # step 1 on the device, 3 logs (voted)
    assert any("nccl" not in k for k in kinds.values()) and any("nccl" in k for k in
                                                                   kinds.values())
