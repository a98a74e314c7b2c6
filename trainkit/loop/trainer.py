"""The training loop, assembled from trainkit's parts.

``global_step`` counts optimizer steps attempted: one per accumulation window, including the
rare steps that are skipped -- fp16 steps whose gradients overflowed and steps whose loss was NaN
or inf. Skipped steps are counted in ``skipped_steps`` and do not advance the LR scheduler or the
EMA. ``trainer.max_steps`` therefore bounds the data consumed, and a checkpoint's step number
always names the same position in the data.

The loop runs the steps and says what happened: the
:class:`~trainkit.checkpoint.checkpointer.Checkpointer` decides about checkpoints (and where the run
starts), the :class:`~trainkit.loop.nonfinite.NonFiniteGuard` about NaN/inf losses, and the metrics
go to the sinks (:mod:`trainkit.observe.sinks`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainkit import rng
from trainkit.checkpoint.checkpointer import Checkpointer
from trainkit.config import CheckpointConfig, TrainerConfig
from trainkit.data.resumable import set_epoch
from trainkit.distributed import ddp, fsdp, group
from trainkit.distributed.ddp import unwrap
from trainkit.distributed.group import StepVote
from trainkit.distributed.watchdog import Watchdog, watched
from trainkit.errors import TrainkitError
from trainkit.loop import evaluation, oom
from trainkit.loop.activations import apply_activation_checkpointing
from trainkit.loop.cpu_settings import keep_freed_memory
from trainkit.loop.cuda_settings import apply_cuda_settings
from trainkit.loop.ema import EMA
from trainkit.loop.nonfinite import NonFiniteGuard, NonFiniteLossError
from trainkit.loop.precision import Precision
from trainkit.loop.step import (
    Criterion,
    Forward,
    WindowStep,
    default_forward,
    steps_per_epoch,
    windows,
)
from trainkit.loop.train_state import TrainState
from trainkit.observe.logging import Progress, log_start, log_window, setup_logging
from trainkit.observe.metrics import StepMeter
from trainkit.observe.sinks import MetricsSink, Sinks, default_sinks
from trainkit.observe.summary import Begun, build_summary, write_hparams, write_summary
from trainkit.runtime import Runtime
from trainkit.signals import Preemption

__all__ = ["NonFiniteLossError", "TrainState", "Trainer"]
log = logging.getLogger("trainkit")


@dataclass
class _Run:
    """One ``fit``'s objects, as the loop's methods share them."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    ema: EMA | None
    data: Any
    criterion: Criterion
    forward: Forward
    total_steps: int
    stop_at_step: int | None
    sinks: Sinks
    meter: StepMeter
    progress: Progress
    evaluate: Callable[[], dict[str, float]] | None = None


class Trainer:
    """Fits a model with the settings of a :class:`TrainerConfig`; usable without Hydra.

    Args:
        config: how to train (precision, accumulation, clipping, limits, ...).
        run_dir: where ``train.log``, ``tb/``, ``metrics.jsonl``, ``checkpoints/`` and
            ``summary.json`` go; None writes nothing.
        checkpoint: when to save, what to resume from (or initialize the weights from).
        runtime: device and ranks; default from ``config.device`` and torchrun's environment.
        run_config: the resolved config of the whole run, stored in checkpoints.
        sinks: more places for the logged metrics, each with ``log(metrics, step)``, beside
            TensorBoard and metrics.jsonl in ``run_dir`` (rank 0 only).

    Example:
        >>> trainer = Trainer(TrainerConfig(max_epochs=2), run_dir="runs/demo")  # doctest: +SKIP
        >>> summary = trainer.fit(model, optimizer, train_loader, val_data=val_loader,
        ...                       metrics={"acc": MulticlassAccuracy(10)})
        >>> summary["metrics"]["val/acc"]
    """

    def __init__(
        self,
        config: TrainerConfig | None = None,
        *,
        run_dir: str | Path | None = None,
        checkpoint: CheckpointConfig | None = None,
        runtime: Runtime | None = None,
        run_config: Mapping[str, Any] | None = None,
        sinks: Sequence[MetricsSink] = (),
    ) -> None:
        self.config = config or TrainerConfig()
        self.runtime = runtime or Runtime.from_env(self.config.device)
        # process-wide settings for the run's device, said in its first log line ("" if none)
        if self.runtime.device.type == "cpu" and self.config.cpu_keep_freed_memory:
            self._settings_text = keep_freed_memory()
        else:
            self._settings_text = apply_cuda_settings(  # nothing off CUDA
                self.runtime.device, cudnn_benchmark=self.config.cudnn_benchmark,
                tf32=self.config.tf32)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.run_config = dict(run_config or {})
        self.precision = Precision(self.config.precision, self.runtime.device)
        self.state = TrainState()
        self._sinks = list(sinks)
        self._watchdog = Watchdog(self.config.hang_timeout_s, self.config.hang_action,
                                  run_dir=self.run_dir, rank=self.runtime.rank,
                                  world_size=self.runtime.world_size)
        self._watchdog.follow(lambda: self.state.global_step)  # no call per step
        self.checkpointer = Checkpointer(checkpoint or CheckpointConfig(), self.run_dir,
                                         self.runtime, self.run_config, self._watchdog)

    # -- public -------------------------------------------------------------------------------

    def fit(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_data: Iterable[Any],
        *,
        criterion: Criterion = F.cross_entropy,
        scheduler: Any = None,
        val_data: Iterable[Any] | None = None,
        metrics: Mapping[str, Any] | None = None,
        forward: Forward = default_forward,
        preemption: Preemption | None = None,
        stop_at_step: int | None = None,
    ) -> dict[str, Any]:
        """Train until ``max_epochs`` or ``max_steps``, evaluating each epoch; return the summary.

        ``train_data`` is any iterable of batches with a length (a DataLoader, an
        :class:`~trainkit.data.InMemoryLoader`, ...); a :class:`~trainkit.data.ResumableData`
        (every trainkit loader) resumes exactly mid-epoch, another ``set_epoch(epoch)`` is
        called every epoch. ``forward(model, batch)`` returns ``(outputs, targets)`` for
        ``criterion`` and the torchmetrics ``metrics``, which are reported as ``val/<name>``.

        ``config.seed`` seeds Python, NumPy and torch as training starts (mixed with the rank),
        so dropout and other random draws repeat from run to run; the model's initial weights
        come from whatever seeded it before (``seed_everything(seed)`` before building it).

        SIGTERM, SIGINT, SIGHUP and SIGUSR1 stop the run after the current step with one
        checkpoint and ``status: "preempted"`` (pass your own :class:`Preemption` to control
        this). A second signal aborts at once. ``stop_at_step`` stops the same way after that
        step, as if a signal had come (``python -m trainkit.verify_resume`` uses it). After a
        preempted fit, exit with :data:`~trainkit.EXIT_PREEMPTED` (75), as the entry point does.

        Raises:
            NonFiniteLossError: ``trainer.nonfinite_patience`` NaN/inf losses in a row; the
                checkpoints written before are left as they were.
            TrainkitError: a checkpoint could not be written or does not fit this run, or the
                device ran out of memory (``status: "oom"``; the allocator's summary is in
                train.log).
        """
        self._begun: tuple[Begun, StepMeter] | None = None  # once training is set up
        started = time.perf_counter()
        try:
            return self._fit(model, optimizer, train_data, criterion=criterion,
                             scheduler=scheduler, val_data=val_data, metrics=metrics,
                             forward=forward, preemption=preemption, stop_at_step=stop_at_step)
        except torch.cuda.OutOfMemoryError as err:  # moving the model, resuming, a step, eval
            oom.release(err, optimizer)
            line, details = oom.report(err, self.runtime.device, step=self.state.global_step,
                                       batch=getattr(train_data, "batch_size", "?"),
                                       accumulate=self.config.accumulate_grad_batches,
                                       precision=self.config.precision)
        self._finish("oom", {}, *(self._begun or (self._begin(started),
                                                  StepMeter(self.runtime.device))))
        raise TrainkitError(line, details=details)

    def evaluate(self, model: nn.Module, data: Iterable[Any], *,
                 criterion: Criterion = F.cross_entropy, metrics: Mapping[str, Any] | None = None,
                 forward: Forward = default_forward) -> dict[str, float]:
        """Mean loss and each metric over ``data`` as ``{"val/loss": ..., "val/<name>": ...}``."""
        return evaluation.evaluate(model, data, precision=self.precision,
                                   device=self.runtime.device, criterion=criterion,
                                   metrics=metrics or {}, forward=forward)

    def planned_steps(self, batches_per_epoch: int) -> int:
        """Optimizer steps this run will take: the smaller of the epoch and step limits."""
        per_epoch = steps_per_epoch(batches_per_epoch, self.config.accumulate_grad_batches)
        by_epochs = per_epoch * self.config.max_epochs
        return by_epochs if self.config.max_steps < 0 else min(by_epochs, self.config.max_steps)

    # -- one fit ------------------------------------------------------------------------------

    def _fit(self, model: nn.Module, optimizer: torch.optim.Optimizer, train_data: Iterable[Any],
             *, criterion: Criterion, scheduler: Any, val_data: Iterable[Any] | None,
             metrics: Mapping[str, Any] | None, forward: Forward, preemption: Preemption | None,
             stop_at_step: int | None) -> dict[str, Any]:
        setup_logging(self.run_dir, self.runtime.is_main)  # this run's train.log, or none
        model = self._prepare_model(model, optimizer)  # DDP/FSDP: rank 0's weights everywhere
        # Training's random draws (dropout, ...) follow from config.seed, each rank its own.
        rng.seed_rank(self.runtime.rank, self.config.seed, device=self.runtime.device)
        ema = EMA(model, self.config.ema_decay) if self.config.ema_decay else None
        started = time.perf_counter()
        total_steps = self.planned_steps(len(train_data))
        self.checkpointer.register(self.state, model=model, optimizer=optimizer,
                                   precision=self.precision, scheduler=scheduler, ema=ema,
                                   data=train_data)
        self.checkpointer.start(total_steps)
        group.check_same_start(self.state.global_step)
        log_start(type(unwrap(model)).__name__, self.runtime, total_steps,
                  steps_per_epoch(len(train_data), self.config.accumulate_grad_batches),
                  self.config, getattr(train_data, "batch_size", None), self._settings_text)
        main = self.runtime.is_main
        run = _Run(model, optimizer, scheduler, ema, train_data, criterion, forward, total_steps,
                   stop_at_step, default_sinks(self.run_dir, main, self._sinks),
                   StepMeter(self.runtime.device),
                   Progress(total_steps, self.state.global_step, enabled=None if main else False))
        if val_data is not None:
            metrics = {name: m.to(self.runtime.device) for name, m in (metrics or {}).items()}
            run.evaluate = functools.partial(self._validate, run, val_data, metrics)
        # this process's share of the run, from where it resumed (also for a run out of memory)
        self._begun = (self._begin(started), run.meter)
        return self._run(run, preemption or Preemption(), *self._begun)

    def _run(self, run: _Run, preemption: Preemption, begun: Begun,
             meter: StepMeter) -> dict[str, Any]:
        """Train, save the last checkpoint, write the summary -- also when the run fails."""
        self._watchdog.on_abort = lambda hang: self._finish(  # hang_action=abort
            "hung", {}, begun, meter, hang=hang)
        try:
            with preemption, run.progress, self._watchdog:
                status, results = self._train(run, preemption)
            if status == "completed":
                self.checkpointer.save(self.state.global_step, last_step=True)
            self.checkpointer.wait()  # the last checkpoint is on disk before the summary says so
        except NonFiniteLossError:
            self._finish("diverged", {}, begun, meter)
            raise
        finally:
            run.sinks.close()
            self.checkpointer.close()  # a write still in flight ends whole, however fit ends
        summary = self._finish(status, results, begun, meter)
        if results and self.runtime.is_main:
            write_hparams(self.run_dir, self.run_config or asdict(self.config), results)
        return summary

    # -- the loop -----------------------------------------------------------------------------

    def _train(self, run: _Run, preemption: Preemption) -> tuple[str, dict[str, float]]:
        """Epochs of steps until done or preempted; returns the status and last val results."""
        cfg, state = self.config, self.state
        model = torch.compile(run.model) if cfg.compile else run.model
        run.meter.restart()
        # Under DDP all ranks must skip, stop and save at the same steps: one vote per step.
        checkpointer = self.checkpointer
        vote = StepVote(stop=lambda: preemption.requested,
                        save_due=checkpointer.time_due if checkpointer.saves_by_time else None)
        self._guard = NonFiniteGuard(cfg.nonfinite_patience, state, checkpointer.last_saved,
                                     self.runtime.device)
        train_step = WindowStep(
            model, optimizer=run.optimizer, precision=self.precision, criterion=run.criterion,
            forward=run.forward, device=self.runtime.device, clip_val=cfg.gradient_clip_val,
            clip_algorithm=cfg.gradient_clip_algorithm,
            agree=vote.nonfinite if vote.active else None)
        self._log_deadline = self._next_log_deadline()
        results: dict[str, float] = {}
        while state.global_step < run.total_steps and state.epoch < cfg.max_epochs:
            set_epoch(run.data, state.epoch, state.batch_in_epoch)
            if self._epoch(run, train_step, vote, preemption):
                return "preempted", results
            done = state.global_step >= run.total_steps
            end_of_epoch = state.batch_in_epoch == 0  # advance() rolled over to the next epoch
            if run.evaluate and (done or (end_of_epoch
                                          and state.epoch % cfg.eval_every_n_epochs == 0)):
                results = run.evaluate()
        if run.evaluate and not results:  # resumed a finished run: report it again
            results = run.evaluate()
        # none pending after a last step; some with a loader shorter than its len()
        self._guard.stop_if_diverged()
        return "completed", results

    def _epoch(self, run: _Run, train_step: WindowStep, vote: StepVote,
               preemption: Preemption) -> bool:
        """One pass over the data (what is left of it); True when the run stopped in it."""
        state, checkpointer, meter = self.state, self.checkpointer, run.meter
        clock = time.perf_counter
        batches = len(run.data)
        run.model.train()
        next_save = checkpointer.next_due(state.global_step)  # one comparison per step
        stop = time_due = False
        stop_at, total = run.stop_at_step, run.total_steps
        fetched = clock()
        for window in windows(run.data, self.config.accumulate_grad_batches):
            # Blocked on the data since the last step ended (time/data_wait_pct).
            meter.data_wait += clock() - fetched
            self._step(run, train_step, window, batches)
            step = state.global_step
            if vote.needed:
                stop, time_due = vote.stop_and_save()
            else:  # one process saving by steps: the signal alone decides
                stop = preemption.requested
            if stop or step == stop_at:
                self._guard.stop_if_diverged()  # counted before the save
                checkpointer.save(step)
                say = log.warning if self.runtime.is_main else log.info  # once per job
                say("stopped at step %d; re-run the same command to resume", step)
                return True
            if time_due or step == next_save:
                # a save never follows NaN/inf steps the host has not counted
                checkpointer.step_done(step, time_due=time_due, may_save=self._guard.steady)
                next_save = checkpointer.next_due(step)
            if step >= total:
                break
            fetched = clock()
        return False

    def _step(self, run: _Run, train_step: WindowStep, window: list[Any],
              batches_per_epoch: int) -> None:
        """One optimizer step over ``window``, counted, metered and logged.

        This runs every step, so its own work is a handful of calls: on a CPU core a small
        model's whole step is ~250 µs, and every call here costs 0.1-0.3 µs of it.
        """
        cfg, state, guard = self.config, self.state, self._guard
        step = state.global_step + 1
        on_host = guard.host_every_step or guard.on_host(
            step % cfg.log_every_n_steps == 0 or step >= run.total_steps
            or self.checkpointer.due(step) or step == run.stop_at_step)
        result = train_step(window, on_host, not on_host and guard.patience > 0)
        # unpacked once: reading a NamedTuple's fields by name is a descriptor call each
        loss, grad_norm, stepped, samples, finite, value, finite_flag = result
        state.advance(len(window), samples, batches_per_epoch)
        if stepped:
            if run.scheduler is not None:
                run.scheduler.step()
            if run.ema is not None:
                run.ema.update()
        else:
            state.skipped_steps += 1
        if not (finite and finite_flag is None and guard.idle):
            guard.record(result, read_first=on_host)  # raises when the run diverged
        # the loss as a number when the NaN check already read it: no second sync; a skipped
        # fp16 step's norm is of overflowed gradients (inf): left out
        run.meter.add(samples, (loss if value is None else value) if finite else None,
                      grad_norm if stepped else None, finite_flag)
        if run.progress.enabled:
            run.progress.step()
        if step % cfg.log_every_n_steps == 0 or time.perf_counter() >= self._log_deadline:
            self._log_train(run)

    @watched("evaluation")
    def _validate(self, run: _Run, data: Iterable[Any],
                  metrics: Mapping[str, Any]) -> dict[str, float]:
        """Evaluate (with the EMA weights when on), log, and let the Checkpointer keep the best."""
        ema, step = run.ema, self.state.global_step
        with ema.applied() if ema is not None else contextlib.nullcontext():
            results = self.evaluate(run.model, data, criterion=run.criterion,
                                    metrics=metrics, forward=run.forward)
        run.sinks.log(results, step)
        log.info("epoch %d step %d %s", self.state.epoch_number, step,
                 " ".join(f"{k} {v:.4f}" for k, v in results.items()))
        self.checkpointer.evaluated(results, step)
        return results

    # -- wiring and reports -------------------------------------------------------------------

    def _prepare_model(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        """Device, layout, activation checkpointing, then DDP or FSDP (compile comes last)."""
        cfg = self.config
        model = model.to(self.runtime.device)
        if cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
        if cfg.activation_checkpointing:
            apply_activation_checkpointing(model, cfg.activation_checkpointing)
        group.init_process_group(self.runtime)  # no-op in one process or when already up
        if fsdp.resolve_strategy(cfg.strategy, self.runtime.world_size) == "fsdp":
            return fsdp.shard_model(model, optimizer, self.runtime, blocks=cfg.fsdp_blocks,
                                    reshard_after_forward=cfg.fsdp_reshard_after_forward,
                                    precision=cfg.precision)
        if cfg.fsdp_blocks:
            log.warning("trainer.fsdp_blocks is ignored: trainer.strategy=%s does not shard "
                        "(set trainer.strategy=fsdp)", cfg.strategy)
        return ddp.wrap_ddp(model, self.runtime)  # auto or ddp; one process: as it is

    def _log_train(self, run: _Run) -> None:
        """The window's figures to the sinks, the console and train.log."""
        scalars = run.meter.read()
        scalars["train/lr"] = run.optimizer.param_groups[0]["lr"]
        scalars["amp/skipped_steps"] = self.state.skipped_steps
        if self.precision.scaler is not None:
            scalars["amp/loss_scale"] = self.precision.scaler.get_scale()
        run.sinks.log(scalars, self.state.global_step)
        run.progress.show(scalars["train/loss"], scalars["throughput/samples_per_s"])
        log_window(scalars, self.state.epoch_number, self.state.global_step, run.total_steps)
        self._log_deadline = self._next_log_deadline()

    def _next_log_deadline(self) -> float:
        """When a log line is due by time (``log_every_n_seconds``), on ``perf_counter``'s clock."""
        seconds = self.config.log_every_n_seconds
        return time.perf_counter() + seconds if seconds else math.inf

    def _begin(self, started: float) -> Begun:
        return Begun(started, self.state.samples_seen, self.state.global_step)

    def _finish(self, status: str, results: dict[str, float], begun: Begun, meter: StepMeter,
                **extra: Any) -> dict[str, Any]:
        summary = build_summary(status, results, self.state.state_dict(), begun,
                                world_size=self.runtime.world_size, peak_memory=meter.peaks(),
                                **extra)
        if self.run_dir is not None and self.runtime.is_main:
            write_summary(self.run_dir, summary)
        return summary
