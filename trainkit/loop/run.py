"""One fit's run: the objects the Trainer's loop methods share, kept apart from the loop."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainkit.config import TrainerConfig
from trainkit.core.runtime import Runtime
from trainkit.core.signals import Preemption
from trainkit.data.sources.packing import real_tokens
from trainkit.distributed import group, strategy
from trainkit.loop.ema import EMA
from trainkit.loop.evaluation import EvalSchedule, LossWatch
from trainkit.loop.micro_batch import MicroBatching, micro_batched
from trainkit.loop.nonfinite import NonFiniteGuard
from trainkit.loop.run_report import RunReport
from trainkit.loop.spike import SpikeGuard
from trainkit.loop.step import Criterion, Forward, WindowStep
from trainkit.observe.logging import Progress
from trainkit.observe.metrics import StepMeter
from trainkit.observe.schedule import LogSchedule


@dataclass
class Run:
    """One ``fit``'s objects, as the loop's methods share them (built by :func:`new_run`;
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
    named: Any = None  # a fit of named models with a step function (loop.context.NamedFit)

    def should_log(self, step: int) -> bool:
        """Whether step ``step`` logs. Under several ranks the time-based part is rank 0's
        decision, agreed in the previous step's vote: each rank's own clock would pick the host
        read of the NaN/inf check on one rank and the device's on another, whose collectives
        differ (docs/distributed.md: no per-rank decision changes a step's collectives)."""
        vote = self.vote
        if vote is None or not vote.active:
            return self.logs.should_log(step)
        due, vote.log_due = vote.log_due, False  # taken: agreed alike on every rank
        if due:
            return True
        if step % self.logs.every_n_steps:
            return False
        self.logs.logged()  # a step-based log restarts the period, as should_log does
        return True

    def build_step(self, model: nn.Module, precision: Any, config: TrainerConfig,
                   profilers: Any, state: Any) -> None:
        """The loop's step: the built-in step (a :class:`WindowStep`) or the fit's step
        function over its context, split into micro-batches as ``config`` asks, seen by the
        spike guard. Under DDP the NaN/inf verdict is every rank's (the vote)."""
        agree = self.vote.nonfinite if self.vote is not None and self.vote.active else None
        if self.named is None:
            step: Any = WindowStep(
                model, optimizer=self.optimizer, precision=precision, criterion=self.criterion,
                forward=self.forward, device=precision.device, clip_val=config.gradient_clip_val,
                clip_algorithm=config.gradient_clip_algorithm, agree=agree,
                scalars=self.meter.own)
        else:  # the step function over its context: the same guarantees, written once there
            step = self.named.context_step(precision, config, agree, self.meter.own, state)
        # trainer.micro_batch_size: each batch split (and, in auto, retried on out-of-memory)
        step = micro_batched(step, config, state, model, profilers)
        self.step = self.spike.wrap(step) if self.spike else step  # sees each loss

    def compiled(self, mode: bool | str) -> nn.Module:
        """The model as the step calls it: compiled when ``trainer.compile`` says (a fit of
        named models: each trained one; the first-named returned)."""
        if self.named is not None:
            return self.named.compile(mode)
        return strategy.compiled(self.model, mode) if mode else self.model

    def evaluation_parts(self, precision: Any) -> tuple[Any, Any]:
        """The evaluation's forward and the scope its models are in (eval mode, all of them)."""
        if self.named is None:
            return self.forward, contextlib.nullcontext()
        return self.named.eval_forward(precision), self.named.evaluating()

    def train_mode(self) -> None:
        """Training mode for the trained models; a model no optimizer holds stays in eval."""
        if self.named is None:
            self.model.train()
            return
        for name, model in self.named.models.items():
            model.train(self.named.trained[name])


def window_tokens(window: Iterable[Any]) -> torch.Tensor | None:
    """The real tokens of a window's text batches, summed on the device (None: not text)."""
    counts = [n for n in map(real_tokens, window) if n is not None]
    return sum(counts) if counts else None


def new_run(config: TrainerConfig, runtime: Runtime, report: RunReport, global_step: int, *,
            total_steps: int, data: Any, val_data: Iterable[Any] | None,
            metrics: Mapping[str, Any] | None, **parts: Any) -> Run:
    """A fit's run: its ``parts`` (model, optimizer, ...) with the meter, the progress bar and
    the logging and evaluation schedules ``config`` asks for, from step ``global_step`` on."""
    tokens = getattr(data, "tokens_per_sample", None)  # a token loader's meter counts tokens/s
    run = Run(data=data, total_steps=total_steps, report=report,
              meter=StepMeter(runtime.device, tokens),
              progress=Progress(total_steps, global_step,
                                enabled=None if runtime.is_main else False),
              logs=LogSchedule(config.log_every_n_steps, config.log_every_n_seconds),
              evals=EvalSchedule(config.eval_every_n_steps, config.eval_every_n_epochs,
                                 total_steps), **parts)
    if val_data is not None:
        run.val_data = val_data
        run.metrics = {name: m.to(runtime.device) for name, m in (metrics or {}).items()}
    return run
