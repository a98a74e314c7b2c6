"""The training loop, assembled from trainkit's parts.

``global_step`` counts optimizer steps attempted, skipped ones (fp16 overflow, NaN/inf loss)
included: they count in ``skipped_steps`` and advance neither the LR scheduler nor the EMA, so a
step number always names the same position in the data. The loop runs the steps and says what
happened; its parts decide: the Checkpointer about checkpoints and where the run starts, the
EvalSchedule and LogSchedule which steps evaluate and log, the StepVote what the ranks agree on,
the NonFiniteGuard and SpikeGuard about bad losses, the strategy how the model is placed, the
RunReport how the run ends (docs/architecture.md, "The path of one step").
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainkit.checkpoint.checkpointer import Checkpointer
from trainkit.config import CheckpointConfig, TrainerConfig
from trainkit.core import rng
from trainkit.core.cuda_settings import apply_device_settings
from trainkit.core.errors import TrainkitError
from trainkit.core.runtime import Runtime
from trainkit.core.schedules import schedule_words
from trainkit.core.signals import Preemption
from trainkit.data.loader.resumable import pass_of
from trainkit.distributed import ddp, group, strategy
from trainkit.distributed.watchdog import Watchdog, watched
from trainkit.loop import evaluation
from trainkit.loop.activations import apply_activation_checkpointing, check_sharded
from trainkit.loop.callbacks import Callbacks
from trainkit.loop.context import NamedFit, StepFn
from trainkit.loop.ema import EMA
from trainkit.loop.nonfinite import NonFiniteGuard, NonFiniteLossError
from trainkit.loop.precision import Precision
from trainkit.loop.preemptible import exit_if_preempted
from trainkit.loop.run import Run, new_run, window_tokens
from trainkit.loop.run_report import RunReport
from trainkit.loop.spike import LossSpikeError, spike_guard
from trainkit.loop.step import Criterion, Forward, default_forward, steps_per_epoch, windows
from trainkit.loop.train_state import TrainState
from trainkit.models.param_groups import apply_freeze, describe
from trainkit.observe.advice import Advisor
from trainkit.observe.logging import log_start, log_window, release_run_log, setup_logging
from trainkit.observe.metrics import FlopsMeter, startup_seconds
from trainkit.observe.profile import profilers
from trainkit.observe.sinks import MetricsSink, default_sinks

__all__ = ["NonFiniteLossError", "TrainState", "Trainer"]
log = logging.getLogger("trainkit")


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

    resume_hint = "re-run the same command to resume"  # a stop's words; the entry point's own

    def __init__(self, config: TrainerConfig | None = None, *, run_dir: str | Path | None = None,
                 checkpoint: CheckpointConfig | None = None, runtime: Runtime | None = None,
                 run_config: Mapping[str, Any] | None = None,
                 sinks: Sequence[MetricsSink] = (), callbacks: Sequence[Any] = ()) -> None:
        self.config = config or TrainerConfig()
        self.runtime = runtime or Runtime.from_env(self.config.device)
        # process-wide settings for the run's device, said in its first log line ("" if none)
        self._settings_text = apply_device_settings(self.config, self.runtime.device)
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
        self._report: RunReport | None = None  # the fit's, for trainer.log
        self._watchdog = Watchdog(self.config.hang_timeout_s, self.config.hang_action,
                                  run_dir=self.run_dir, rank=self.runtime.rank,
                                  world_size=self.runtime.world_size)
        state = self.state  # not self, which holds the watchdog: no reference cycle
        self._watchdog.follow(lambda: state.global_step)  # no call per step
        self.checkpointer = Checkpointer(checkpoint or CheckpointConfig(), self.run_dir,
                                         self.runtime, self.run_config, self._watchdog)

    # -- public -------------------------------------------------------------------------------

    def fit(self, model: nn.Module | Mapping[str, nn.Module],
            optimizer: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer],
            train_data: Iterable[Any], *, criterion: Criterion | None = None,
            scheduler: Any = None, val_data: Iterable[Any] | None = None,
            metrics: Mapping[str, Any] | None = None, forward: Forward = default_forward,
            preemption: Preemption | None = None, stop_at_step: int | None = None,
            step: StepFn | None = None, schedulers: Mapping[str, Any] | None = None,
            evaluate: Callable[[Any, Any], tuple[Any, ...]] | None = None) -> dict[str, Any]:
        """Train until ``max_epochs`` or ``max_steps`` (or a stop), evaluating on ``val_data``
        with the torchmetrics ``metrics`` (as ``val/<name>``); return the run's summary.

        ``train_data`` has a length (a :class:`~trainkit.data.ResumableData` resumes mid-epoch);
        ``forward(model, batch)`` returns ``(outputs, targets)``, optionally with ``{name: scalar}``
        logged as ``train/<name>``; ``criterion(outputs, targets)`` (default cross-entropy) the
        loss, or ``(loss, {name: part})`` with each part logged as ``train/<name>`` and
        ``val/<name>``. A signal, like ``stop_at_step``, stops the run after the current
        step with a checkpoint; a re-run of a completed run trains nothing (docs/training.md).

        Your own step: ``model`` and ``optimizer`` may be dicts by name, ``schedulers`` a dict
        by optimizer name, and ``step(ctx, batch)`` (a :class:`~trainkit.StepContext`) is called
        once per micro-batch; ``evaluate(ctx, batch)`` returns ``(outputs, targets)`` for the
        metrics (and ``criterion``, when given, for ``val/loss``). Evaluation runs in eval mode
        under ``no_grad``, on a random stream of its own (docs/research.md, "Your own step").

        Raises:
            NonFiniteLossError: ``trainer.nonfinite_patience`` NaN/inf losses in a row.
            LossSpikeError: more loss spikes than ``trainer.spike`` rolls back.
            TrainkitError: a checkpoint could not be written or does not fit this run, or the
                device ran out of memory (``status: "oom"``).
        """
        # several models or a step of your own: named parts (the context steps the schedulers)
        named, model, optimizer, scheduler, criterion = NamedFit.of(
            model, optimizer, criterion, step, forward, schedulers, scheduler, evaluate)
        advisor = Advisor(self.runtime.device, train_data) if self.config.advice else None
        report = RunReport(self.runtime, self.run_dir, self.state, advisor, self._profilers)
        with report:  # its sinks and profilers closed however the fit ends, after the summary
            try:
                run = self._setup(model, optimizer, train_data, report, criterion=criterion,
                                  scheduler=scheduler, val_data=val_data, metrics=metrics,
                                  forward=forward, preemption=preemption or Preemption(),
                                  stop_at_step=stop_at_step, named=named)
                return run if isinstance(run, dict) else self._run(run)  # dict: it had ended
            except torch.cuda.OutOfMemoryError as err:  # moving the model, resuming, a step, eval
                error = report.out_of_memory(
                    err, optimizer, batch=getattr(train_data, "batch_size", "?"),
                    accumulate=self.config.accumulate_grad_batches, precision=self.precision.mode)
            finally:  # what this trainer keeps holds none of the fit's data (its loader's workers)
                self.checkpointer.release_data()
            raise error  # outside the handler: the failed step's frames are gone

    def request_stop(self, reason: str = "stop requested") -> None:
        """Stop the run after the current step, on every rank, with one checkpoint.

        Callable from any rank (from a callback, say): the ranks agree at the step's end. The
        run ends with ``"status": "stopped"`` and ``reason`` in summary.json and train.log (the
        entry point exits 0); a re-run of the same command trains no further.
        """
        if self._stop_reason is None:
            self._stop_reason = str(reason)

    def log(self, **scalars: float | torch.Tensor) -> None:
        """Log each scalar as ``train/<name>`` at the current step, into the fit's sinks
        (TensorBoard, metrics.jsonl, trackers): from any callback hook.

        A tensor is read on the host (a sync): callbacks log where they read anyway.

        Raises:
            TrainkitError: called outside ``fit``.
        """
        if self._report is None:
            raise TrainkitError("trainer.log(...) logs during fit (from a callback hook)")
        self._report.log_now(scalars, self.state.global_step)

    def evaluate(self, model: nn.Module, data: Iterable[Any], *, forward: Forward = default_forward,
                 criterion: Criterion | None = F.cross_entropy,
                 metrics: Mapping[str, Any] | None = None) -> dict[str, float]:
        """Mean loss (``criterion=None``: none) and each metric over ``data`` as
        ``{"val/loss": ..., "val/<name>": ...}``, in eval mode under ``no_grad``, on the
        evaluation's random stream (the training stream does not move)."""
        return evaluation.evaluate_apart(
            self.config.seed, self.runtime, model, data, precision=self.precision,
            criterion=criterion, device=self.runtime.device, metrics=metrics, forward=forward,
            max_batches=self.config.eval_max_batches)

    def planned_steps(self, batches_per_epoch: int) -> int:
        """Optimizer steps this run will take: the smaller of the epoch and step limits."""
        per_epoch = steps_per_epoch(batches_per_epoch, self.config.accumulate_grad_batches)
        by_epochs = per_epoch * self.config.epoch_limit
        return by_epochs if self.config.max_steps < 0 else min(by_epochs, self.config.max_steps)

    def prepare_model(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        """``model`` as fit trains it, before compiling: activation checkpointing, then the
        strategy's placement (:func:`trainkit.distributed.strategy.prepare_model`)."""
        # trainer.freeze: frozen before DDP/FSDP see which parameters train
        apply_freeze(model, self.config, 0, world_size=self.runtime.world_size)
        apply_activation_checkpointing(model, self.config.activation_checkpointing)  # [] is off
        # FLOPs counted on a meta copy of the model as it computes (recomputation included)
        self.flops = FlopsMeter.of(model, self.precision, self.config.peak_tflops)
        # selective checkpointing around FSDP units: refused
        return check_sharded(strategy.prepare_model(model, optimizer, self.config, self.runtime,
                                                    self.precision.mode))

    # -- setting up one fit -------------------------------------------------------------------

    def _setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, train_data: Any,
               report: RunReport, **parts: Any) -> Run | dict[str, Any]:
        """The run to train, its parts resumed; or the summary of a run that already ended."""
        setup_logging(self.run_dir, self.runtime.is_main)  # this run's train.log, or none
        named: NamedFit | None = parts["named"]
        self._report = report
        # DDP/FSDP: rank 0's weights everywhere
        model = (self.prepare_model(model, optimizer) if named is None else
                 named.place(self.prepare_model, self.config, self.runtime))
        # Training's random draws (dropout, ...) follow from config.seed, each rank its own.
        rng.seed_rank(self.runtime.rank, self.config.seed, device=self.runtime.device)
        ema = EMA(model, self.config.ema_decay) if self.config.ema_decay else None
        started, total_steps = time.perf_counter(), self.planned_steps(len(train_data))
        self._stop_reason, callbacks = None, self.callbacks  # the Checkpointer resumes the parts
        self.checkpointer.register(self.state, model=model, optimizer=optimizer,
                                   precision=self.precision, scheduler=parts["scheduler"], ema=ema,
                                   data=train_data,
                                   callbacks=callbacks if callbacks.stateful else None,
                                   named=named.checkpoint_parts() if named else None)
        if callbacks.handlers["on_checkpoint"]:
            self.checkpointer.on_saved = functools.partial(callbacks.fire, "on_checkpoint", self)
        self.checkpointer.start(total_steps)
        release_run_log()  # the run is accepted: its checkpoint (if any) fits this config
        finished = report.already_ended(total_steps, self.config.epoch_limit)
        if finished is not None:  # a re-run of an ended run: nothing to train or write
            return finished
        # the run as resumed (a tracker continues its run): the config of the whole run, or
        # the trainer's own settings for a library user who passed none
        report.open_sinks(default_sinks(self.run_dir, self.runtime.is_main, self._sinks),
                          self.run_config or asdict(self.config))
        run = new_run(self.config, self.runtime, report, self.state.global_step, model=model,
                      optimizer=optimizer, ema=ema, data=train_data, total_steps=total_steps,
                      **parts)
        # the first step is next (timed from the process start only where that means it)
        report.begin(run.meter, started, *startup_seconds(report.started))
        log_start(type(ddp.unwrap(model)).__name__, self.runtime, total_steps,
                  steps_per_epoch(len(train_data), self.config.accumulate_grad_batches),
                  self.config, getattr(train_data, "batch_size", None), self._settings_text,
                  precision=self.precision.describe(), startup_s=report.startup_s,
                  setup_s=report.setup_s,
                  params=describe(model, optimizer, schedule_words(parts["scheduler"])))
        if self.precision.warning:
            log.warning(self.precision.warning)
        return run

    def _run(self, run: Run) -> dict[str, Any]:
        """Train, save the last checkpoint, write the summary -- also when the run fails."""
        self._watchdog.on_abort = run.report.abort_hung
        state, status = self.state, None
        try:
            with run.preemption, run.progress, self._watchdog:
                self._start_training(run)
                while status is None and (  # a run stopped by request is over
                        state.global_step < run.total_steps
                        and state.epoch < self.config.epoch_limit and state.stop_reason is None):
                    status = self._epoch(run)
                if status is None:  # trained to its end, or resumed there
                    if run.val_data is not None and not run.results:  # report it again
                        self._validate(run)
                    # none pending after a last step; some with a loader shorter than its len()
                    run.guard.stop_if_diverged()
                    status = "stopped" if state.stop_reason else "completed"
            if status == "completed":
                self.checkpointer.save(state.global_step, last_step=True)
            self.checkpointer.wait()  # the last checkpoint is on disk before the summary says so
        except (NonFiniteLossError, LossSpikeError):  # its last evaluation stays its result
            run.report.finish("diverged", run.results or {})
            raise
        finally:
            self.checkpointer.close()  # a write still in flight ends whole, however fit ends
            self._watchdog.on_abort = None  # its report holds the run's data
            self._report = None
        extra = {"stop_reason": state.stop_reason} if status == "stopped" else {}
        # best: checkpoint.monitor's best checkpoint, or None; the data's skipped files
        summary = run.report.finish(status, run.results or {}, **extra,
                                    best=self.checkpointer.best(),
                                    **getattr(run.data, "report", dict)(),
                                    **self.flops.summary())
        run.report.hparams(self.run_config or asdict(self.config), run.results or {})
        self.callbacks.fire("on_fit_end", self, summary)
        exit_if_preempted(summary)  # inside trainkit.preemptible(): exit 75 now
        return summary

    def _start_training(self, run: Run) -> None:
        """The step, the vote and the NaN/inf guard, as training starts (after compiling)."""
        cfg, state = self.config, self.state
        model = run.compiled(cfg.compile)  # as the step calls it (each trained model compiled)
        run.meter.flops = self.flops.watch(model)  # FLOPs and MFU: counted at the first call
        self.callbacks.fire("on_fit_start", self)
        run.meter.restart()
        # Under DDP all ranks must skip, stop and save at the same steps: one vote per step.
        preemption = run.preemption  # not the run: the run holds the vote (no reference cycle)
        run.spike = spike_guard(cfg.spike, state, self.checkpointer, run, self.runtime)
        # the time-based log decision: rank 0's clock, carried by the vote to the next step, so
        # that every rank reads its NaN/inf check alike (the two ways issue other collectives)
        run.vote = group.StepVote(lambda: preemption.requested or self._stop_reason is not None,
                                  save_due=self.checkpointer.time_due,
                                  spike=run.spike.pending if run.spike else None,
                                  log_due=run.logs.due_by_time if self.runtime.is_main else None)
        # fused fp16 steps skipped on the device are counted where the guard reads anyway
        run.guard = NonFiniteGuard(cfg.nonfinite_patience, state, self.checkpointer.last_saved,
                                   self.runtime.device, skips=self.precision.read_skips)
        run.build_step(model, self.precision, cfg, self._profilers, state)
        run.evals.enabled = run.val_data is not None
        run.logs.logged()  # the first line by time is due a period from now
        run.report.time_first(run, cfg.compile)  # the cold start, said as the fit ends

    # -- the loop -----------------------------------------------------------------------------

    def _epoch(self, run: Run) -> str | None:
        """One pass over (what is left of) the data; the status when the run stopped in it.

        Before each step the LogSchedule says whether it logs; after it: the log, the callbacks'
        ``on_step_end``, an evaluation when due, the ranks' vote on stopping, then the
        Checkpointer: a checkpoint holds what the step's evaluation and callbacks made of it.
        """
        state, checkpointer, vote, guard = self.state, self.checkpointer, run.vote, run.guard
        epoch_batches = pass_of(run.data, state.epoch, state.batch_in_epoch)
        apply_freeze(ddp.unwrap(run.model), self.config, state.epoch)  # unfreeze_at_epoch
        clock, fire, batches = time.perf_counter, self.callbacks.fire, len(run.data)
        run.train_mode()
        run.evals.start_epoch(state.global_step, state.epoch, state.global_step + steps_per_epoch(
            batches - state.batch_in_epoch, self.config.accumulate_grad_batches))
        step_end = self.callbacks.handlers["on_step_end"]
        # a callback may ask to stop after the step's own vote (its NaN check): vote again
        vote_again = bool(step_end or self.callbacks.handlers["on_evaluation_end"])
        fetched = clock()
        for window in windows(epoch_batches, self.config.accumulate_grad_batches):
            run.meter.data_wait += clock() - fetched  # blocked on the data since the last step
            logs = run.should_log(state.global_step + 1)
            self._step(run, window, batches, logs)
            step = state.global_step
            if logs:
                self._log_train(run)
            if step_end:
                fire("on_step_end", self, step)
            if run.evals.due(step):
                self._validate(run)
            stop, save = vote.stop_and_save(vote_again)
            stop = stop or step == run.stop_at_step
            # a spike all ranks agreed on: back to the last good state, past these batches
            rolled = run.spike and run.spike.after_step(step, vote.spiked, guard, stop or save)
            if stop:
                self._save_and_stop(run, step)
                return "stopped" if state.stop_reason else "preempted"
            # a save never follows NaN/inf steps the host has not counted
            checkpointer.step_done(step, time_due=save, may_save=guard.steady)
            if rolled or step >= run.total_steps:  # rolled: a new pass from after the batches
                return None
            fetched = clock()
        return None

    def _step(self, run: Run, window: list[Any], batches_per_epoch: int, logs: bool) -> None:
        """One optimizer step over ``window``, counted and metered. Its NaN/inf check is read on
        the host where the host waits anyway: a logging step (``logs``), a save, the last step."""
        state, guard = self.state, run.guard
        step = state.global_step + 1
        on_host = guard.host_every_step or guard.on_host(
            logs or step >= run.total_steps or self.checkpointer.due(step)
            or step == run.stop_at_step)
        result = run.step(window, on_host, not on_host and guard.patience > 0)
        state.advance(len(window), result.samples, batches_per_epoch)
        if result.stepped:
            if run.scheduler is not None:
                run.scheduler.step()
            if run.ema is not None:
                run.ema.update()
        else:
            state.skipped_steps += 1
        guard.record(result, read_first=on_host)  # raises when the run diverged
        run.meter.add(result.samples, result.logged_loss, result.logged_grad_norm,
                      result.finite_flag, tokens=window_tokens(window))
        run.progress.step()

    def _save_and_stop(self, run: Run, step: int) -> None:
        """Stop after step ``step`` on every rank (a signal, stop_at_step, or request_stop)."""
        run.guard.stop_if_diverged()  # counted before the save
        # the reason of whichever rank asked (a collective: all ranks stop at this step)
        reason = next((r for r in group.all_gather(self._stop_reason) if r is not None), None)
        # a request's reason (None: a signal) in the checkpoint: a re-run then trains no further
        self.state.stop_reason = reason
        self.checkpointer.save(step, again=reason is not None)  # the state changed since
        (log.warning if self.runtime.is_main else log.info)(  # once per job
            f"stopped at step {step}: {reason}" if reason else
            f"stopped at step {step}; {self.resume_hint}")

    @watched("evaluation")
    def _validate(self, run: Run) -> dict[str, float]:
        """Evaluate (with the EMA weights when on), log, tell the callbacks, and let the
        Checkpointer keep the best (last: its checkpoint holds the callbacks' new state)."""
        ema, step = run.ema, self.state.global_step
        forward, models = run.evaluation_parts(self.precision)
        with ema.applied() if ema is not None else contextlib.nullcontext(), models:
            results = evaluation.evaluate_apart(  # as self.evaluate does
                self.config.seed, self.runtime, run.model, run.val_data, precision=self.precision,
                criterion=run.criterion, device=self.runtime.device, metrics=run.metrics,
                forward=forward, max_batches=self.config.eval_max_batches)
        run.report.sinks.log(results, step)
        log.info("epoch %d step %d %s", self.state.epoch_number, step,
                 " ".join(f"{k} {v:.4f}" for k, v in results.items()))
        run.results = results
        run.loss_watch.check(results, step, self.runtime.is_main)
        self.callbacks.fire("on_evaluation_end", self, results, step)
        self.checkpointer.evaluated(results, step)
        return results

    def _log_train(self, run: Run) -> None:
        """The window's figures to the sinks, the console and train.log."""
        state = self.state
        run.guard.read()  # what the device counted: NaN/inf and fused fp16 skips (host waits)
        scalars = {**run.meter.read(), "train/lr": run.optimizer.param_groups[0]["lr"],
                   "amp/skipped_steps": state.skipped_steps}
        scalars.update(run.named.rates() if run.named is not None else {})
        if self.precision.scaler is not None:
            scalars["amp/loss_scale"] = self.precision.scaler.get_scale()
        run.report.log(scalars, state.global_step)
        run.progress.show(scalars["train/loss"], scalars["throughput/samples_per_s"])
        log_window(scalars, state.epoch_number, state.global_step, run.total_steps)
        run.report.advise(scalars, state.global_step, run.step)
