"""The LR schedules built from torch's schedulers give the LRs of their closed forms, and resume."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from trainkit.core.errors import ConfigError
from trainkit.core.schedules import advance, constant, warmup_cosine


def _closed_form(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """warmup_cosine's factor at ``step`` as trainkit defined it before it used torch's parts."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _optimizer(*lrs: float) -> torch.optim.Optimizer:
    return torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)], "lr": lr}
                            for lr in lrs])


def _lrs(optimizer: torch.optim.Optimizer, scheduler: object, steps: int) -> list[list[float]]:
    """Each group's lr before every step, as the loop sees them."""
    seen = []
    for _ in range(steps):
        seen.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return seen


@pytest.mark.parametrize(("total", "warmup", "min_ratio"),
                         [(1, 0, 0.0), (5, 1, 0.0), (10, 3, 0.1), (100, 0, 0.05), (300, 40, 0.0),
                          (7, 7, 0.0)])
def test_warmup_cosine_gives_the_closed_form_lr_at_every_step(total: int, warmup: int,
                                                               min_ratio: float) -> None:
    optimizer = _optimizer(0.3)
    scheduler = warmup_cosine(optimizer, total, warmup_steps=warmup, min_ratio=min_ratio)
    got = [lr for (lr,) in _lrs(optimizer, scheduler, total)]
    want = [0.3 * _closed_form(step, total, warmup, min_ratio) for step in range(total)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_warmup_cosine_scales_each_group_and_refuses_one_floor_for_different_lrs() -> None:
    optimizer = _optimizer(0.1, 0.01)
    got = _lrs(optimizer, warmup_cosine(optimizer, 20, warmup_steps=4), 20)
    for step, (a, b) in enumerate(got):
        assert (a, b) == pytest.approx((0.1 * _closed_form(step, 20, 4, 0.0),
                                        0.01 * _closed_form(step, 20, 4, 0.0)), rel=1e-12)
    with pytest.raises(ConfigError, match=r"sched.min_ratio=0.1 needs one lr"):
        warmup_cosine(_optimizer(0.1, 0.01), 20, min_ratio=0.1)


def test_constant_keeps_the_lr() -> None:
    optimizer = _optimizer(0.2, 0.05)
    assert _lrs(optimizer, constant(optimizer, 10), 10) == [[0.2, 0.05]] * 10


@pytest.mark.parametrize("at", [2, 5, 17])
def test_warmup_cosine_resumes_from_its_state_dict_and_advances_like_a_run(at: int) -> None:
    total, warmup = 30, 5
    optimizer = _optimizer(0.3)
    scheduler = warmup_cosine(optimizer, total, warmup_steps=warmup, min_ratio=0.1)
    first = _lrs(optimizer, scheduler, at)
    saved = scheduler.state_dict()
    # a fresh run, as a resume builds it, loads the state and goes on where the first would
    resumed = _optimizer(0.3)
    fresh = warmup_cosine(resumed, total, warmup_steps=warmup, min_ratio=0.1)
    fresh.load_state_dict(saved)
    resumed.param_groups[0]["lr"] = optimizer.param_groups[0]["lr"]  # the optimizer's state
    rest = _lrs(resumed, fresh, total - at)
    want = [0.3 * _closed_form(step, total, warmup, 0.1) for step in range(total)]
    assert [lr for (lr,) in first + rest] == pytest.approx(want, rel=1e-12)
    # an extended run's fresh scheduler brought to step `at` has that step's lr of its plan
    extended = _optimizer(0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # advance() hides torch's warning; nothing else warns
        planned = warmup_cosine(extended, 2 * total, warmup_steps=warmup, min_ratio=0.1)
        advance(planned, at)
    assert extended.param_groups[0]["lr"] == pytest.approx(
        0.3 * _closed_form(at, 2 * total, warmup, 0.1), rel=1e-12)
