"""The LR schedules built from torch's schedulers give the LRs of their closed forms, and resume."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from trainkit.core.errors import ConfigError
from trainkit.core.schedules import advance, constant, warmup_cosine, wsd


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


def _wsd_factor(step: int, total: int, warmup: int, fraction: float, min_ratio: float) -> float:
    """WSD's factor at ``step``: linear warm-up, 1, then linear towards ``min_ratio``."""
    decay = round(fraction * total)
    if step < warmup:
        return (step + 1) / warmup
    if step < total - decay:
        return 1.0
    return 1 - (step - (total - decay)) / decay * (1 - min_ratio)


@pytest.mark.parametrize(("total", "warmup", "fraction", "min_ratio"),
                         [(20, 4, 0.25, 0.0), (10, 0, 0.5, 0.1), (50, 10, 0.2, 0.0),
                          (8, 2, 0.0, 0.0), (6, 0, 1.0, 0.0)])
def test_wsd_warms_up_holds_then_decays_over_the_last_fraction(
        total: int, warmup: int, fraction: float, min_ratio: float) -> None:
    optimizer = _optimizer(0.3)
    scheduler = wsd(optimizer, total, warmup_steps=warmup, decay_fraction=fraction,
                    min_ratio=min_ratio)
    got = [lr for (lr,) in _lrs(optimizer, scheduler, total)]
    want = [0.3 * _wsd_factor(s, total, warmup, fraction, min_ratio) for s in range(total)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert min(got) >= 0


def test_wsd_extended_keeps_the_lr_of_every_step_before_its_decay() -> None:
    short, long = _optimizer(0.1, 0.01), _optimizer(0.1, 0.01)
    first = _lrs(short, wsd(short, 100, warmup_steps=10, decay_fraction=0.2), 100)
    longer = _lrs(long, wsd(long, 300, warmup_steps=10, decay_fraction=0.2), 300)
    assert longer[:80] == first[:80]  # warm-up and the stable phase the short run had taken
    assert first[80] == [0.1, 0.01] and first[99] < first[80]  # the short run's decay began
    assert longer[80:240] == [[0.1, 0.01]] * 160  # the longer one stays stable to its own
    # a checkpoint of the short run's step 60, re-planned over 300 steps (the checkpointer's
    # advance), goes on at the LR the 300-step run has there
    resumed = _optimizer(0.1, 0.01)
    scheduler = wsd(resumed, 300, warmup_steps=10, decay_fraction=0.2)
    advance(scheduler, 60)
    assert _lrs(resumed, scheduler, 240) == longer[60:]


def test_wsd_refuses_bad_fractions_and_a_warm_up_into_the_decay() -> None:
    with pytest.raises(ConfigError, match=r"sched.decay_fraction=1.5 and sched.min_ratio=0.0 "
                                          r"must each be in \[0, 1\]"):
        wsd(_optimizer(0.1), 10, decay_fraction=1.5)
    with pytest.raises(ConfigError, match=r"sched.warmup_steps=9 reaches into the decay, which "
                                          r"starts at step 8 of 10"):
        wsd(_optimizer(0.1), 10, warmup_steps=9, decay_fraction=0.2)
