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
from trainkit.loop.callbacks import Callbacks
from trainkit.loop.cpu_settings import keep_freed_memory
from trainkit.loop.cuda_settings import apply_cuda_settings
from trainkit.loop.ema import EMA
from trainkit.loop.micro_batch import MicroBatching, check_strategy
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
from trainkit.observe.advice import Advisor
from trainkit.observe.logging import Progress, log_start, log_window, setup_logging
from trainkit.observe.metrics import StepMeter, startup_seconds
from trainkit.observe.profile import profilers
from trainkit.observe.sinks import MetricsSink, Sinks, default_sinks
from trainkit.observe.summary import (
    Begun,
    build_summary,
    read_summary,
    write_hparams,
    write_summary,
)
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
    results: dict[str, float] | None = None  # of the last evaluation
    step: WindowStep | None = None  # set as training starts


class Trainer:
    """Fits a model with the settings of a :class:`TrainerConfig`; usable without Hydra.

    Args:
        config: how to train (precision, accumulation, clipping, limits, ...).
        run_dir: where ``train.log``, ``tb/``, ``metrics.jsonl``, ``checkpoints/`` and
            ``summary.json`` go; None writes nothing.
        checkpoint: when to save, what to resume from (or initialize the weights from).
        runtime: device and ranks; default from ``config.device`` and torchrun's environment.
        run_config: the resolved config of the whole run, stored in checkpoints.
        sinks: more places for the logged metrics, each with ``log(metrics, step)`` (and,
            optionally, ``start``, ``finish``, ``close``: see :mod:`trainkit.observe.sinks`), beside
            TensorBoard and metrics.jsonl in ``run_dir`` (rank 0 only), e.g.
            :class:`~trainkit.MLflowSink`, :class:`~trainkit.WandbSink`.
        callbacks: objects with any of ``on_fit_start``, ``on_step_end``, ``on_evaluation_end``,
            ``on_checkpoint``, ``on_fit_end`` (:class:`~trainkit.loop.callbacks.Callback`), run
            on every rank; one with ``state_dict``/``load_state_dict`` is in every checkpoint.

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
        callbacks: Sequence[Any] = (),
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
        # trainer.profile: a callback of its own, only when on (nothing per step otherwise)
        self._profilers = profilers(self.config.profile, self.run_dir, self.runtime.rank,
                                    self.runtime.device)
        self.callbacks = Callbacks([*callbacks, *self._profilers])  # raises on two states, one key
        self._stop_reason: str | None = None
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
        """Train until ``max_epochs`` or ``max_steps`` (or a stop), evaluating each epoch (and
        every ``eval_every_n_steps``); return the summary.

        ``train_data`` is any iterable of batches with a length (a DataLoader, an
        :class:`~trainkit.data.InMemoryLoader`, ...); a :class:`~trainkit.data.ResumableData`
        (every trainkit loader) resumes exactly mid-epoch, another ``set_epoch(epoch)`` is
        called every epoch. ``forward(model, batch)`` returns ``(outputs, targets)`` for
        ``criterion`` and the torchmetrics ``metrics``, which are reported as ``val/<name>``. It
        may return a third item, ``{name: scalar}`` (0-d tensors or numbers: an auxiliary loss,
        tokens seen): each is averaged on the device over the logging window and logged as
        ``train/<name>`` (rank 0's; read on the host at logging steps only).

        ``config.seed`` seeds Python, NumPy and torch as training starts (mixed with the rank),
        so dropout and other random draws repeat from run to run; the model's initial weights
        come from whatever seeded it before (``seed_everything(seed)`` before building it).

        SIGTERM, SIGINT, SIGHUP and SIGUSR1 stop the run after the current step with one
        checkpoint and ``status: "preempted"`` (pass your own :class:`Preemption` to control
        this). A second signal aborts at once. ``stop_at_step`` stops the same way after that
        step, as if a signal had come (``python -m trainkit.verify_resume`` uses it). After a
        preempted fit, exit with :data:`~trainkit.EXIT_PREEMPTED` (75), as the entry point does.
        Resuming a run that already completed (its ``summary.json`` says so at the step it
        resumes from) says so in one line and returns that summary: nothing is trained,
        evaluated or written.

        Raises:
            NonFiniteLossError: ``trainer.nonfinite_patience`` NaN/inf losses in a row; the
                checkpoints written before are left as they were.
            TrainkitError: a checkpoint could not be written or does not fit this run, or the
                device ran out of memory (``status: "oom"``; the allocator's summary is in
                train.log).
        """
        self._begun: tuple[Begun, StepMeter] | None = None  # once training is set up
        self._startup_s: float | None = None  # process start to the first step, once known
        self._setup_s: float | None = None  # this fit's call to its first step, once known
        self._fit_started = time.perf_counter()
        self._run_sinks = Sinks()  # this fit's, once set up; closed however the fit ends
        # what holds the run back, said once each (train.log, summary.json `advice`)
        self._advisor = Advisor(self.runtime.device, train_data) if self.config.advice else None
        started = time.perf_counter()
        try:
            try:
                return self._fit(model, optimizer, train_data, criterion=criterion,
                                 scheduler=scheduler, val_data=val_data, metrics=metrics,
                                 forward=forward, preemption=preemption,
                                 stop_at_step=stop_at_step)
            except torch.cuda.OutOfMemoryError as err:  # moving the model, resuming, a step, eval
                for profiler in self._profilers:  # the memory snapshot, as it ran out
                    profiler.out_of_memory(err)
                # the figures first: release() empties the cache, a new meter resets the peak
                line, details = oom.report(err, self.runtime.device, step=self.state.global_step,
                                           batch=getattr(train_data, "batch_size", "?"),
                                           accumulate=self.config.accumulate_grad_batches,
                                           precision=self.precision.mode)
                begun = self._begun or (self._begin(started), oom.Peaks(self.runtime.device))
                oom.release(err, optimizer)
            self._finish("oom", {}, *begun)
            raise TrainkitError(line, details=details)
        finally:  # after the summary went to the sinks: a tracker flushes before the exit
            self._run_sinks.close()
            for profiler in self._profilers:
                profiler.close()

    def request_stop(self, reason: str = "stop requested") -> None:
        """Stop the run after the current step, on every rank, with one checkpoint.

        Callable from any rank (from a callback, say): the ranks agree at the step's end. The
        run ends with ``"status": "stopped"`` and ``reason`` in summary.json and train.log (the
        entry point exits 0); a re-run of the same command trains no further.
        """
        if self._stop_reason is None:
            self._stop_reason = str(reason)

    def evaluate(self, model: nn.Module, data: Iterable[Any], *,
                 criterion: Criterion = F.cross_entropy, metrics: Mapping[str, Any] | None = None,
                 forward: Forward = default_forward) -> dict[str, float]:
        """Mean loss and each metric over ``data`` as ``{"val/loss": ..., "val/<name>": ...}``."""
        return evaluation.evaluate(model, data, precision=self.precision,
                                   device=self.runtime.device, criterion=criterion,
                                   metrics=metrics or {}, forward=forward,
                                   max_batches=self.config.eval_max_batches)

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
        model = self.prepare_model(model, optimizer)  # DDP/FSDP: rank 0's weights everywhere
        # Training's random draws (dropout, ...) follow from config.seed, each rank its own.
        rng.seed_rank(self.runtime.rank, self.config.seed, device=self.runtime.device)
        ema = EMA(model, self.config.ema_decay) if self.config.ema_decay else None
        started = time.perf_counter()
        total_steps = self.planned_steps(len(train_data))
        self._stop_reason = None
        callbacks = self.callbacks
        self.checkpointer.register(self.state, model=model, optimizer=optimizer,
                                   precision=self.precision, scheduler=scheduler, ema=ema,
                                   data=train_data,
                                   callbacks=callbacks if callbacks.stateful else None)
        if callbacks.handlers["on_checkpoint"]:
            self.checkpointer.on_saved = functools.partial(callbacks.fire, "on_checkpoint", self)
        self.checkpointer.start(total_steps)
        group.check_same_start(self.state.global_step)
        finished = self._finished_summary(total_steps)
        if finished is not None:  # a re-run of a completed run: nothing to train or write
            return finished
        main = self.runtime.is_main
        run = _Run(model, optimizer, scheduler, ema, train_data, criterion, forward, total_steps,
                   stop_at_step, default_sinks(self.run_dir, main, self._sinks),
                   StepMeter(self.runtime.device),
                   Progress(total_steps, self.state.global_step, enabled=None if main else False))
        self._run_sinks = run.sinks
        # the run as resumed (a tracker continues its run): the config of the whole run, or
        # the trainer's own settings for a library user who passed none
        run.sinks.start(self.run_dir, self.run_config or asdict(self.config))
        if val_data is not None:
            metrics = {name: m.to(self.runtime.device) for name, m in (metrics or {}).items()}
            run.evaluate = functools.partial(self._validate, run, val_data, metrics)
        # all set up: the first step is next (from the process start only where that means it)
        self._startup_s, self._setup_s = startup_seconds(self._fit_started)
        log_start(type(unwrap(model)).__name__, self.runtime, total_steps,
                  steps_per_epoch(len(train_data), self.config.accumulate_grad_batches),
                  self.config, getattr(train_data, "batch_size", None), self._settings_text,
                  precision=self.precision.describe(), startup_s=self._startup_s,
                  setup_s=self._setup_s)
        if self.precision.warning:
            log.warning(self.precision.warning)
        # this process's share of the run, from where it resumed (also for a run out of memory)
        self._begun = (self._begin(started), run.meter)
        return self._run(run, preemption or Preemption(), *self._begun)

    def _run(self, run: _Run, preemption: Preemption, begun: Begun,
             meter: StepMeter) -> dict[str, Any]:
        """Train, save the last checkpoint, write the summary -- also when the run fails."""
        self._watchdog.on_abort = functools.partial(self._abort_hung, begun, meter)
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
            self.checkpointer.close()  # a write still in flight ends whole, however fit ends
        reason = self.state.stop_reason
        summary = self._finish(status, results, begun, meter,
                               **({"stop_reason": reason} if status == "stopped" else {}))
        if results and self.runtime.is_main:
            write_hparams(self.run_dir, self.run_config or asdict(self.config), results)
        self.callbacks.fire("on_fit_end", self, summary)
        return summary

    # -- the loop -----------------------------------------------------------------------------

    def _train(self, run: _Run, preemption: Preemption) -> tuple[str, dict[str, float]]:
        """Epochs of steps until done, preempted or stopped; returns the status and the last
        evaluation's results."""
        cfg, state = self.config, self.state
        model = self._compiled(run.model) if cfg.compile else run.model
        self.callbacks.fire("on_fit_start", self)
        run.meter.restart()
        # Under DDP all ranks must skip, stop and save at the same steps: one vote per step.
        checkpointer = self.checkpointer
        vote = StepVote(stop=lambda: preemption.requested or self._stop_reason is not None,
                        save_due=checkpointer.time_due if checkpointer.saves_by_time else None)
        self._guard = NonFiniteGuard(cfg.nonfinite_patience, state, checkpointer.last_saved,
                                     self.runtime.device)
        train_step = WindowStep(
            model, optimizer=run.optimizer, precision=self.precision, criterion=run.criterion,
            forward=run.forward, device=self.runtime.device, clip_val=cfg.gradient_clip_val,
            clip_algorithm=cfg.gradient_clip_algorithm,
            agree=vote.nonfinite if vote.active else None, scalars=run.meter.own)
        run.step = train_step
        if cfg.micro_batch_size is not None:  # each batch split (and, in auto, retried on OOM)
            check_strategy(model, cfg.micro_batch_size)
            train_step = MicroBatching(
                train_step, cfg.micro_batch_size, state, compiled=cfg.compile,
                on_oom=self._profilers[0].out_of_memory if self._profilers else None)
        self._log_deadline = self._next_log_deadline()
        if state.stop_reason is not None:  # resumed a run that was stopped: it is over
            log.info("this run stopped at step %d (%s): nothing more to train",
                     state.global_step, state.stop_reason)
        while (state.global_step < run.total_steps and state.epoch < cfg.max_epochs
               and state.stop_reason is None):
            set_epoch(run.data, state.epoch, state.batch_in_epoch)
            if self._epoch(run, train_step, vote, preemption):
                return ("stopped" if state.stop_reason else "preempted"), run.results or {}
        if run.evaluate and not run.results:  # resumed a finished run: report it again
            run.evaluate()
        # none pending after a last step; some with a loader shorter than its len()
        self._guard.stop_if_diverged()
        return ("stopped" if state.stop_reason else "completed"), run.results or {}

    def _epoch(self, run: _Run, train_step: WindowStep, vote: StepVote,
               preemption: Preemption) -> bool:
        """One pass over the data (what is left of it); True when the run stopped in it.

        After each step: the callbacks' ``on_step_end``, an evaluation when one is due, then the
        vote on stopping (a signal, :meth:`request_stop`), then a periodic checkpoint: a
        checkpoint holds what the step's evaluation and callbacks made of it.
        """
        state, checkpointer, meter = self.state, self.checkpointer, run.meter
        clock = time.perf_counter
        batches, k = len(run.data), self.config.accumulate_grad_batches
        run.model.train()
        next_save = checkpointer.next_due(state.global_step)  # one comparison per step
        epoch_end = state.global_step + steps_per_epoch(batches - state.batch_in_epoch, k)
        next_eval = self._next_eval(run, state.global_step, epoch_end)  # the same
        step_end = self.callbacks.handlers["on_step_end"]  # empty: nothing to call
        fire = self.callbacks.fire
        # a callback may ask to stop after the step's own vote (its NaN check): vote again
        vote_again = bool(step_end or self.callbacks.handlers["on_evaluation_end"])
        stop = time_due = False
        stop_at, total = run.stop_at_step, run.total_steps
        fetched = clock()
        for window in windows(run.data, k):
            # Blocked on the data since the last step ended (time/data_wait_pct).
            meter.data_wait += clock() - fetched
            self._step(run, train_step, window, batches)
            step = state.global_step
            if step_end:
                fire("on_step_end", self, step)
            if step == next_eval:
                run.evaluate()
                next_eval = self._next_eval(run, step, epoch_end)
            if vote.needed:
                stop, time_due = vote.stop_and_save(vote_again)
            else:  # one process saving by steps: the signal or a request alone decides
                stop = preemption.requested or self._stop_reason is not None
            if stop or step == stop_at:
                self._save_and_stop(step)
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

    def _save_and_stop(self, step: int) -> None:
        """Stop after step ``step`` on every rank (a signal, stop_at_step, or request_stop)."""
        self._guard.stop_if_diverged()  # counted before the save
        # the reason of whichever rank asked (a collective: all ranks stop at this step)
        reasons = group.all_gather(self._stop_reason)
        reason = next((r for r in reasons if r is not None), None)
        say = log.warning if self.runtime.is_main else log.info  # once per job
        if reason is None:
            self.checkpointer.save(step)
            say("stopped at step %d; re-run the same command to resume", step)
            return
        self.state.stop_reason = reason  # in the checkpoint: a re-run trains no further
        self.checkpointer.save(step, again=True)
        say("stopped at step %d: %s", step, reason)

    def _next_eval(self, run: _Run, step: int, epoch_end: int) -> int:
        """The first step after ``step`` that evaluates (0: none): every
        ``eval_every_n_steps``, the epoch's last step when ``eval_every_n_epochs`` says so, the
        run's last step. A function of the step: a resumed run evaluates where the first would."""
        if run.evaluate is None:
            return 0
        cfg, due = self.config, [run.total_steps]
        if cfg.eval_every_n_steps:
            due.append((step // cfg.eval_every_n_steps + 1) * cfg.eval_every_n_steps)
        if epoch_end > step and (self.state.epoch + 1) % cfg.eval_every_n_epochs == 0:
            due.append(epoch_end)
        return min(due)

    @watched("evaluation")
    def _validate(self, run: _Run, data: Iterable[Any],
                  metrics: Mapping[str, Any]) -> dict[str, float]:
        """Evaluate (with the EMA weights when on), log, tell the callbacks, and let the
        Checkpointer keep the best (last: its checkpoint holds the callbacks' new state)."""
        ema, step = run.ema, self.state.global_step
        with ema.applied() if ema is not None else contextlib.nullcontext():
            results = self.evaluate(run.model, data, criterion=run.criterion,
                                    metrics=metrics, forward=run.forward)
        run.sinks.log(results, step)
        log.info("epoch %d step %d %s", self.state.epoch_number, step,
                 " ".join(f"{k} {v:.4f}" for k, v in results.items()))
        run.results = results
        self.callbacks.fire("on_evaluation_end", self, results, step)
        self.checkpointer.evaluated(results, step)
        return results

    # -- wiring and reports -------------------------------------------------------------------

    def prepare_model(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        """``model`` as fit trains it: on the device, in its memory layout, with activation
        checkpointing, then in DDP or FSDP (compile comes last, in fit); ``trainkit probe``
        prepares its model the same way."""
        cfg = self.config
        model = model.to(self.runtime.device)
        sharded = fsdp.resolve_strategy(cfg.strategy, self.runtime.world_size) == "fsdp"
        if cfg.channels_last and sharded:
            # fully_shard takes contiguous parameters only; a convolution given NHWC inputs
            # (the loaders make them) computes in NHWC whatever its weights' layout
            log.info("channels_last: the inputs only (fully_shard takes contiguous weights; "
                     "convolutions follow their inputs' layout)")
        elif cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
        if cfg.activation_checkpointing:
            apply_activation_checkpointing(model, cfg.activation_checkpointing)
        group.init_process_group(self.runtime)  # no-op in one process or when already up
        if sharded:
            return fsdp.shard_model(model, optimizer, self.runtime, blocks=cfg.fsdp_blocks,
                                    reshard_after_forward=cfg.fsdp_reshard_after_forward,
                                    precision=self.precision.mode)
        if cfg.fsdp_blocks:
            log.warning("trainer.fsdp_blocks is ignored: trainer.strategy=%s does not shard "
                        "(set trainer.strategy=fsdp)", cfg.strategy)
        return ddp.wrap_ddp(model, self.runtime)  # auto or ddp; one process: as it is

    @staticmethod
    def _compiled(model: nn.Module) -> nn.Module:
        """``torch.compile``: the whole model, or under FSDP each unit's forward in place
        (compiling the sharded whole would compile nothing: :func:`fsdp.compile_units`)."""
        if fsdp.is_sharded(model):
            units, eager = fsdp.compile_units(model)
            shown = units if len(units) <= 4 else [*units[:2], "...", units[-1]]
            log.info("compile: the forward of %d FSDP unit%s (%s), FSDP's gathers eager between "
                     "them%s", len(units), "" if len(units) == 1 else "s", ", ".join(shown),
                     f"; {len(eager)} one-layer units eager" if eager else "")
            return model
        log.info("compile: the whole model (torch.compile)")
        return torch.compile(model)

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
        if self._advisor is not None:
            for line in self._advisor.window(scalars, self.state.global_step, run.step):
                (log.warning if self.runtime.is_main else log.info)(line)  # once per job
        self._log_deadline = self._next_log_deadline()

    def _next_log_deadline(self) -> float:
        """When a log line is due by time (``log_every_n_seconds``), on ``perf_counter``'s clock."""
        seconds = self.config.log_every_n_seconds
        return time.perf_counter() + seconds if seconds else math.inf

    def _finished_summary(self, total_steps: int) -> dict[str, Any] | None:
        """The summary of the completed run this one resumed at its end, else None."""
        state = self.state
        stopped = state.stop_reason is not None  # by request_stop: over, however long planned
        if not state.global_step or (not stopped and state.global_step < total_steps
                                     and state.epoch < self.config.max_epochs):
            return None
        summary = read_summary(self.run_dir) if self.runtime.is_main else None
        summary = group.all_gather(summary)[0]  # rank 0's: every rank decides alike
        if (not summary or summary.get("status") != ("stopped" if stopped else "completed")
                or summary.get("global_step") != state.global_step):
            return None  # stopped at its last step: evaluate and complete it now
        if stopped:
            log.info("this run stopped at step %d (%s): nothing more to train",
                     state.global_step, state.stop_reason)
            return summary
        log.info("the run is complete at step %d of %d: nothing to do (raise trainer.max_steps "
                 "or trainer.max_epochs to train on)", state.global_step, total_steps)
        return summary

    def _begin(self, started: float) -> Begun:
        return Begun(started, self.state.samples_seen, self.state.global_step)

    def _finish(self, status: str, results: dict[str, float], begun: Begun, meter: StepMeter,
                **extra: Any) -> dict[str, Any]:
        advisor = self._advisor  # set by fit before anything can finish
        counters = {**self.state.state_dict(), "epoch_number": self.state.epoch_number}
        summary = build_summary(status, results, counters, begun,
                                world_size=self.runtime.world_size, peak_memory=meter.peaks(),
                                startup_s=self._startup_s, setup_s=self._setup_s,
                                advice=list(advisor.lines) if advisor else [], **extra)
        if self.run_dir is not None and self.runtime.is_main:
            write_summary(self.run_dir, summary)
        self._run_sinks.finish(status, summary)  # rank 0's sinks; none elsewhere
        return summary

    def _abort_hung(self, begun: Begun, meter: StepMeter, hang: Any) -> None:
        """``hang_action=abort``: the summary, to the sinks too, before the process exits."""
        self._finish("hung", {}, begun, meter, hang=hang)
        self._run_sinks.close()
