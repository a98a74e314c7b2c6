"""LR schedules built from the number of optimizer steps the run will take.

Each factory takes ``(optimizer, total_steps, ...)`` so configs need not know the data size.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.optim.lr_scheduler import (
    ConstantLR,
    CosineAnnealingLR,
    LinearLR,
    LRScheduler,
    OneCycleLR,
    SequentialLR,
)

from trainkit.core.errors import ConfigError


def one_cycle(optimizer: torch.optim.Optimizer, total_steps: int, *, pct_start: float = 0.25,
              div_factor: float = 25.0, final_div_factor: float = 1e4) -> LRScheduler:
    """Warm up to each group's ``lr``, then anneal to nearly zero (cosine), in ``total_steps``.

    The momentum (or Adam's beta1) cycles against the lr, as torch's does, when every group has
    one of them; groups of both kinds (``optim=muon``: Muon's momentum, AdamW's betas) keep
    theirs."""
    max_lr = [group["lr"] for group in optimizer.param_groups]
    cycle = any(all(key in group for group in optimizer.param_groups)
                for key in ("betas", "momentum"))
    if total_steps > 1 and pct_start * total_steps <= 1:
        # OneCycleLR divides by zero when its warm-up phase is shorter than one step (short
        # smoke runs): give it just over one.
        pct_start = min(1.0, 1.5 / total_steps)
    scheduler = OneCycleLR(optimizer, max_lr=max_lr, total_steps=total_steps,
                           pct_start=pct_start, div_factor=div_factor,
                           final_div_factor=final_div_factor, cycle_momentum=cycle)
    return described(scheduler, f"one-cycle schedule: up from lr/{div_factor:g} over "
                                f"{round(pct_start * total_steps)} of {total_steps} steps, then "
                                f"cosine down to lr/{div_factor * final_div_factor:g}")


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, *,
                  warmup_steps: int = 0, min_ratio: float = 0.0) -> LRScheduler:
    """Linear warm-up for ``warmup_steps``, then cosine decay to ``min_ratio`` x lr.

    torch's own schedules: ``LinearLR`` from lr / ``warmup_steps`` (the first step's) to lr,
    then ``CosineAnnealingLR`` over the remaining steps, joined by ``SequentialLR``.

    Raises:
        ConfigError: ``min_ratio`` > 0 with param groups of different ``lr`` (the cosine's floor,
            ``eta_min``, is one number for all groups).
    """
    lrs = {group["lr"] for group in optimizer.param_groups}
    if min_ratio and len(lrs) > 1:
        raise ConfigError(f"sched.min_ratio={min_ratio} needs one lr for all param groups (got "
                          f"{sorted(lrs)}): torch's CosineAnnealingLR has one floor; set "
                          "sched.min_ratio=0")
    cosine = CosineAnnealingLR(optimizer, T_max=max(1, total_steps - warmup_steps),
                               eta_min=min_ratio * max(lrs))
    floor = f"{min_ratio:g} x lr" if min_ratio else "0"
    if not warmup_steps:
        return described(cosine, f"cosine schedule from lr to {floor} over {total_steps} steps")
    # step i of the warm-up has lr (i + 1) / warmup_steps x lr: 1 / warmup_steps at step 0
    warmup = LinearLR(optimizer, start_factor=1 / warmup_steps, end_factor=1.0,
                      total_iters=max(1, warmup_steps - 1))
    return described(SequentialLR(optimizer, [warmup, cosine], milestones=[warmup_steps]),
                     f"linear warm-up to lr over {warmup_steps} steps, then cosine to {floor} "
                     f"over {max(1, total_steps - warmup_steps)} steps")


def wsd(optimizer: torch.optim.Optimizer, total_steps: int, *, warmup_steps: int = 0,
        decay_fraction: float = 0.2, min_ratio: float = 0.0) -> LRScheduler:
    """Warm-up, stable, decay: linear warm-up for ``warmup_steps``, the full lr, then a linear
    decay towards ``min_ratio`` x lr (reached as the run ends) over the last ``decay_fraction``
    of ``total_steps``.

    torch's own schedules joined by ``SequentialLR``: ``LinearLR`` (warm-up), ``ConstantLR``
    (factor 1), ``LinearLR`` (decay). The decay is counted from the end, so a longer run has the
    same LR at every step before the shorter one's decay began (an extended run stays stable).

    Raises:
        ConfigError: ``decay_fraction`` outside [0, 1], ``min_ratio`` outside [0, 1], or a
            warm-up that reaches into the decay.
    """
    if not 0 <= decay_fraction <= 1 or not 0 <= min_ratio <= 1:
        raise ConfigError(f"sched.decay_fraction={decay_fraction} and sched.min_ratio="
                          f"{min_ratio} must each be in [0, 1]")
    decay_steps = round(decay_fraction * total_steps)
    decay_start = total_steps - decay_steps
    if warmup_steps > decay_start:
        raise ConfigError(f"sched.warmup_steps={warmup_steps} reaches into the decay, which "
                          f"starts at step {decay_start} of {total_steps} (sched.decay_fraction="
                          f"{decay_fraction}): lower sched.warmup_steps or raise "
                          "trainer.max_steps")
    # (first step, schedule) of each phase that has steps: an empty one is left out, as torch
    # 2.11's SequentialLR starts a schedule at milestone 0 a step late
    phases: list[tuple[int, LRScheduler]] = []
    if warmup_steps:  # step i of the warm-up has lr (i + 1) / warmup_steps x lr, as warmup_cosine's
        phases.append((0, LinearLR(optimizer, start_factor=1 / warmup_steps, end_factor=1.0,
                                   total_iters=max(1, warmup_steps - 1))))
    if decay_start > warmup_steps:
        phases.append((warmup_steps, ConstantLR(optimizer, factor=1.0, total_iters=0)))
    # step decay_start + j of the decay: lr x (1 - j / decay_steps x (1 - min_ratio)), the
    # floor reached as the run ends (the last step a decay step above it, never below zero)
    phases.append((decay_start, LinearLR(optimizer, start_factor=1.0, end_factor=min_ratio,
                                         total_iters=max(1, decay_steps))))
    schedule = phases[0][1] if len(phases) == 1 else SequentialLR(
        optimizer, [phase for _, phase in phases], milestones=[start for start, _ in phases[1:]])
    warm = f"linear warm-up to lr over {warmup_steps} steps, " if warmup_steps else ""
    return described(schedule, f"{warm}lr held to step {decay_start}, then linear decay to "
                     f"{min_ratio:g} x lr over the last {decay_steps} steps")


def constant(optimizer: torch.optim.Optimizer, total_steps: int) -> LRScheduler:
    """Keep each group's ``lr`` unchanged (``ConstantLR`` with factor 1)."""
    return described(ConstantLR(optimizer, factor=1.0, total_iters=0), "constant lr")


def described(scheduler: LRScheduler, words: str) -> LRScheduler:
    """``scheduler`` with ``words`` as its ``description``, which the run's first line shows."""
    scheduler.description = words  # type: ignore[attr-defined]
    return scheduler


def schedule_words(scheduler: Any) -> str:
    """A schedule in words: its ``description`` (:func:`described`), else its class's name."""
    if scheduler is None:
        return ""
    return getattr(scheduler, "description", None) or f"{type(scheduler).__name__} schedule"


def advance(scheduler: Any, steps: int) -> None:
    """Step a fresh ``scheduler`` ``steps`` times: it then gives the LR of that step of its plan.

    For schedules whose LR is a function of their step count (all of the above, and torch's
    closed-form ones); the optimizer's param groups get that LR, as after a real step.
    """
    with warnings.catch_warnings():  # torch warns of scheduler steps before optimizer steps
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
        for _ in range(steps):
            scheduler.step()
