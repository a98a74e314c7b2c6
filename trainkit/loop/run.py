"""One fit's run: the objects the Trainer's loop methods share, kept apart from the loop."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainkit.core.signals import Preemption
from trainkit.distributed import group
from trainkit.loop.ema import EMA
from trainkit.loop.evaluation import EvalSchedule, LossWatch
from trainkit.loop.micro_batch import MicroBatching
from trainkit.loop.nonfinite import NonFiniteGuard
from trainkit.loop.run_report import RunReport
from trainkit.loop.spike import SpikeGuard
from trainkit.loop.step import Criterion, Forward, WindowStep
from trainkit.observe.logging import Progress
from trainkit.observe.metrics import StepMeter
from trainkit.observe.schedule import LogSchedule


@dataclass
class Run:
    """One ``fit``'s objects, as the loop's methods share them (built by ``Trainer._new_run``;
    the step, the vote and the guard once training starts). None of them refers back to the
    run: with no reference cycle it goes, with the user's data, as soon as ``fit`` returns."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    ema: EMA | None
    data: Any
    criterion: Criterion
    forward: Forward
    total_steps: int
    stop_at_step: int | None
    report: RunReport
    meter: StepMeter
    progress: Progress
    logs: LogSchedule
    evals: EvalSchedule
    preemption: Preemption
    val_data: Iterable[Any] | None = None  # evaluated with metrics, when given
    metrics: Mapping[str, Any] = field(default_factory=dict)
    results: dict[str, float] | None = None  # of the last evaluation
    loss_watch: LossWatch = field(default_factory=LossWatch)  # a diverging val/loss said once
    step: WindowStep | MicroBatching | None = None  # set as training starts
    vote: group.StepVote | None = None  # the same
    guard: NonFiniteGuard | None = None  # the same
    spike: SpikeGuard | None = None  # the same, when trainer.spike is enabled
