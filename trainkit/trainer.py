"""The training loop, assembled from trainkit's parts.

``global_step`` counts optimizer steps attempted: one per accumulation window, including the
rare steps that are skipped -- fp16 steps whose gradients overflowed and steps whose loss was NaN
or inf. Skipped steps are counted in ``skipped_steps`` and do not advance the LR scheduler or the
EMA. ``trainer.max_steps`` therefore bounds the data consumed, and a checkpoint's step number
always names the same position in the data.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from trainkit import distributed, oom, rng
from trainkit.activations import apply_activation_checkpointing
from trainkit.async_checkpoint import AsyncCheckpointWriter
from trainkit.checkpoint import CheckpointManager, check_config, load_checkpoint, manifest
from trainkit.config import CheckpointConfig, TrainerConfig
from trainkit.cuda_settings import apply_cuda_settings
from trainkit.data.loaders import set_epoch
from trainkit.device import move_to_device
from trainkit.distributed import StepVote, barrier, unwrap
from trainkit.ema import EMA
from trainkit.errors import TrainkitError
from trainkit.logging import Progress, make_writer, setup_logging, write_hparams, write_summary
from trainkit.metrics import StepMeter
from trainkit.nonfinite import NonFiniteCounter, NonFiniteTally
from trainkit.precision import Precision
from trainkit.runtime import Runtime
from trainkit.signals import Preemption
from trainkit.step import Criterion, Forward, batch_size, default_forward, train_window, windows
from trainkit.watchdog import Watchdog, watched

log = logging.getLogger("trainkit")


class NonFiniteLossError(TrainkitError):
    """The loss was NaN or inf for ``trainer.nonfinite_patience`` steps in a row."""


@dataclass
class TrainState:
    """Where the loop is; saved in every checkpoint."""

    global_step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of `epoch` already trained on
    samples_seen: int = 0
    skipped_steps: int = 0  # fp16 overflows and non-finite losses
    nonfinite_steps: int = 0
    nonfinite_streak: int = 0
    best_metric: float | None = None  # of checkpoint.monitor

    @property
    def epoch_number(self) -> int:
        """The last step's epoch counted from 1, as log lines name it (``epoch`` counts the
        completed ones: right after an epoch's last step both are that epoch's number)."""
        return self.epoch + (self.batch_in_epoch > 0)


class Parts(NamedTuple):
    """The objects one ``fit`` trains; each with state is checkpointed via its state_dict()."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    ema: EMA | None
    data: Any


class Outputs(NamedTuple):
    """Where one ``fit`` reports: TensorBoard, the window meter, the console bar."""

    writer: Any
    meter: StepMeter
    progress: Progress


class Trainer:
    """Fits a model with the settings of a :class:`TrainerConfig`; usable without Hydra.

    Args:
        config: how to train (precision, accumulation, clipping, limits, ...).
        run_dir: where ``train.log``, ``tb/``, ``checkpoints/`` and ``summary.json`` go;
            None writes nothing.
        checkpoint: when to save and what to resume from.
        runtime: device and ranks; default from ``config.device`` and torchrun's environment.
        run_config: the resolved config of the whole run, stored in checkpoints.

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
    ) -> None:
        self.config = config or TrainerConfig()
        self.checkpoint_config = checkpoint or CheckpointConfig()
        self.runtime = runtime or Runtime.from_env(self.config.device)
        self._cuda_text = apply_cuda_settings(  # "" off CUDA; said in the first log line
            self.runtime.device, cudnn_benchmark=self.config.cudnn_benchmark, tf32=self.config.tf32)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.run_config = dict(run_config or {})
        self.precision = Precision(self.config.precision, self.runtime.device)
        self.state = TrainState()
        self.checkpoints = (
            CheckpointManager(self.run_dir / "checkpoints", self.checkpoint_config.keep_last)
            if self.run_dir is not None else None
        )
        if self.run_dir is not None:
            setup_logging(self.run_dir, self.runtime.is_main)
        if self.checkpoints is not None and self.runtime.is_main:
            self.checkpoints.check_writable()
        self._background = (  # checkpoint.async_save: writes leave the training thread
            AsyncCheckpointWriter(self.checkpoints)
            if self.checkpoints is not None and self.checkpoint_config.async_save else None)
        self._saved_at: tuple[int, float] = (-1, time.monotonic())  # (step, time) of last save
        self._watchdog = Watchdog(self.config.hang_timeout_s, self.config.hang_action,
                                  run_dir=self.run_dir, rank=self.runtime.rank,
                                  world_size=self.runtime.world_size)

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
        :class:`~trainkit.data.InMemoryLoader`, ...); when it has ``set_epoch`` it is called every
        epoch. ``forward(model, batch)`` returns ``(outputs, targets)`` for ``criterion`` and the
        torchmetrics ``metrics``, which are reported as ``val/<name>``.

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
        self._begun: tuple[float, tuple[int, int], StepMeter] | None = None
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
        begun = self._begun or (started, (self.state.samples_seen, self.state.global_step),
                                StepMeter(self.runtime.device))
        self._write_summary("oom", {}, *begun)
        raise TrainkitError(line, details=details)

    def _fit(self, model: nn.Module, optimizer: torch.optim.Optimizer, train_data: Iterable[Any],
             *, criterion: Criterion, scheduler: Any, val_data: Iterable[Any] | None,
             metrics: Mapping[str, Any] | None, forward: Forward, preemption: Preemption | None,
             stop_at_step: int | None) -> dict[str, Any]:
        cfg = self.config
        setup_logging(self.run_dir, self.runtime.is_main)  # this run's train.log, or none
        model = self._prepare_model(model)  # under DDP: rank 0's weights on every rank
        # Training's random draws (dropout, ...) follow from config.seed, each rank its own.
        rng.seed_rank(self.runtime.rank, cfg.seed)
        ema = EMA(model, cfg.ema_decay) if cfg.ema_decay else None
        parts = Parts(model, optimizer, scheduler, ema, train_data)
        started = time.perf_counter()
        self._maybe_resume(parts)
        distributed.check_same_start(self.state.global_step)
        total_steps = self.planned_steps(len(train_data))
        _check_schedule_length(scheduler, total_steps)
        log.info("training %s on %s for %d steps (%d per epoch), precision %s, %s",
                 type(unwrap(model)).__name__, self.runtime.device, total_steps,
                 math.ceil(len(train_data) / cfg.accumulate_grad_batches), cfg.precision,
                 _batch_text(train_data, cfg.accumulate_grad_batches, self.runtime.world_size)
                 + (f", {self._cuda_text}" if self._cuda_text else ""))
        out = Outputs(make_writer(self.run_dir, self.runtime.is_main),
                      StepMeter(self.runtime.device),
                      Progress(total_steps, self.state.global_step,
                               enabled=None if self.runtime.is_main else False))
        metrics = {name: m.to(self.runtime.device) for name, m in (metrics or {}).items()}
        evaluate = (lambda: self._validate(parts, val_data, out.writer, criterion, metrics,
                                           forward)) if val_data is not None else None
        begin = (self.state.samples_seen, self.state.global_step)  # this process's own share
        self._begun = (started, begin, out.meter)  # for the summary of a run out of memory
        preemption = preemption or Preemption()
        self._watchdog.on_abort = lambda hang: self._write_summary(  # hang_action=abort
            "hung", {}, started, begin, out.meter, hang=hang)
        try:
            with preemption, out.progress, self._watchdog:
                status, results = self._train(parts, criterion, forward, evaluate, out,
                                              total_steps, preemption, stop_at_step)
            if status == "completed" and self.checkpoint_config.save_last:
                self._save(parts, periodic=bool(self.checkpoint_config.every_n_steps))
            if self._background is not None:
                self._background.wait()  # the last checkpoint is on disk before the summary says so
        except NonFiniteLossError:
            self._write_summary("diverged", {}, started, begin, out.meter)
            raise
        finally:
            out.writer.close()
            if self._background is not None:
                self._background.close()  # a write still in flight ends whole, however fit ends
        summary = self._write_summary(status, results, started, begin, out.meter)
        if results and self.runtime.is_main:
            write_hparams(self.run_dir, self.run_config or asdict(cfg), results)
        return summary

    @torch.no_grad()
    def evaluate(
        self,
        model: nn.Module,
        data: Iterable[Any],
        *,
        criterion: Criterion = F.cross_entropy,
        metrics: Mapping[str, Any] | None = None,
        forward: Forward = default_forward,
    ) -> dict[str, float]:
        """Mean loss and each metric over ``data`` as ``{"val/loss": ..., "val/<name>": ...}``."""
        device = self.runtime.device
        # Not through DDP: it broadcasts buffers before every forward, a collective that ranks
        # with different numbers of val batches would not match. Rank 0's buffers (batch-norm
        # statistics drift per rank) make the result that of the checkpointed weights.
        model = unwrap(model)
        distributed.broadcast_buffers(model)
        was_training = model.training
        model.eval()
        metrics = metrics or {}
        for metric in metrics.values():
            metric.reset()
        loss_sum, count = torch.zeros((), device=device), 0
        for batch in data:
            batch = move_to_device(batch, device)
            n = batch_size(batch)
            with self.precision.autocast():
                outputs, targets = forward(model, batch)
                loss_sum += criterion(outputs, targets).float() * n
            for metric in metrics.values():
                metric.update(outputs, targets)
            count += n
        if distributed.is_distributed():  # each rank saw its own shard: sum over all of them
            total, count = distributed.sum_across_ranks(loss_sum, count)
            results = {"val/loss": total / max(count, 1)}
        else:
            results = {"val/loss": loss_sum.item() / max(count, 1)}
        # torchmetrics syncs its states across ranks in compute() when a process group is up
        results.update({f"val/{name}": float(m.compute()) for name, m in metrics.items()})
        model.train(was_training)
        return results

    def planned_steps(self, batches_per_epoch: int) -> int:
        """Optimizer steps this run will take: the smaller of the epoch and step limits."""
        per_epoch = math.ceil(batches_per_epoch / self.config.accumulate_grad_batches)
        by_epochs = per_epoch * self.config.max_epochs
        return by_epochs if self.config.max_steps < 0 else min(by_epochs, self.config.max_steps)

    def state_dict(self, parts: Parts) -> dict[str, Any]:
        """Everything a checkpoint holds, each part asked for its own state."""
        return {
            "model": unwrap(parts.model).state_dict(),
            "optimizer": parts.optimizer.state_dict(),
            "scheduler": _state_of(parts.scheduler),
            "precision": self.precision.state_dict(),
            "ema": _state_of(parts.ema),
            "data": _state_of(parts.data),
            "trainer": asdict(self.state),
            "global_step": self.state.global_step,
            "epoch": self.state.epoch,
            "rng": rng.get_rng_state(),
            "config": self.run_config,
            "manifest": self._manifest,
        }

    def load_state_dict(self, state: Mapping[str, Any], parts: Parts) -> None:
        """Restore a checkpoint made by :meth:`state_dict` into these objects."""
        check_config(state, self.run_config)
        try:
            unwrap(parts.model).load_state_dict(state["model"])
        except torch.cuda.OutOfMemoryError:
            raise  # not a mismatch: fit reports it as out of memory
        except RuntimeError as err:  # torch lists every missing/unexpected key: details
            raise TrainkitError(
                "checkpoint does not fit this model (other layers or shapes): use the model "
                "config it was saved with, another hydra.run.dir, or checkpoint.resume=null",
                details=[f"checkpoint: {state.get('_path', '?')}", *str(err).splitlines()]
            ) from None
        parts.optimizer.load_state_dict(state["optimizer"])
        if parts.scheduler is not None and state.get("scheduler") is not None:
            parts.scheduler.load_state_dict(state["scheduler"])
        self.precision.load_state_dict(state["precision"])
        if parts.ema is not None:
            if state.get("ema") is not None:
                parts.ema.load_state_dict(state["ema"])
            else:
                log.warning("checkpoint has no EMA weights: the average starts from here")
        if state.get("data") is not None and hasattr(parts.data, "load_state_dict"):
            parts.data.load_state_dict(state["data"])
        self.state = TrainState(**state["trainer"])
        rng.set_rng_state(rng.rng_of_rank(state, self.runtime.rank))

    # -- the loop -----------------------------------------------------------------------------

    def _train(self, parts: Parts, criterion: Criterion, forward: Forward, evaluate: Any,
               out: Outputs, total_steps: int, preemption: Preemption,
               stop_at_step: int | None) -> tuple[str, dict[str, float]]:
        """Epochs of steps until done or preempted; returns the status and last val results."""
        cfg, state, data, meter = self.config, self.state, parts.data, out.meter
        train_model = torch.compile(parts.model) if cfg.compile else parts.model
        results: dict[str, float] = {}
        done = state.global_step >= total_steps
        check_finite, log_every = cfg.nonfinite_patience > 0, cfg.log_every_n_steps
        log_seconds, last_log = cfg.log_every_n_seconds, time.monotonic()
        bar = out.progress.enabled
        meter.restart()
        # Under DDP all ranks must skip, stop and save at the same steps: one vote per step.
        vote = StepVote(stop=lambda: preemption.requested, save_due=self._time_due)
        agree = vote.nonfinite if vote.active else None
        self._nonfinite = NonFiniteCounter()  # NaN/inf windows of steps the host did not check
        while not done and state.epoch < cfg.max_epochs:
            set_epoch(data, state.epoch, state.batch_in_epoch)
            per_epoch = len(data)
            parts.model.train()
            fetched = time.perf_counter()
            for window in windows(data, cfg.accumulate_grad_batches):
                # Blocked on the data since the last step ended (time/data_wait_pct).
                meter.data_wait += time.perf_counter() - fetched
                on_host = check_finite and self._checks_on_host(state.global_step + 1,
                                                                total_steps, stop_at_step)
                result = train_window(
                    train_model, window, optimizer=parts.optimizer, precision=self.precision,
                    criterion=criterion, forward=forward, device=self.runtime.device,
                    clip_val=cfg.gradient_clip_val, clip_algorithm=cfg.gradient_clip_algorithm,
                    check_finite=on_host, guard_finite=check_finite and not on_host, agree=agree,
                )
                # the steps the device checked are counted first: this one may extend a streak
                tally = self._read_nonfinite() if on_host else None
                if result.finite_flag is not None:
                    self._nonfinite.add(result.finite_flag)
                self._count(result, parts, len(window), per_epoch)
                self._watchdog.beat(state.global_step)
                if tally is not None:
                    self._stop_if_diverged(tally)
                # the loss as a number when the NaN check already read it: no second sync
                loss = result.loss if result.value is None else result.value
                # a skipped fp16 step's norm is of overflowed gradients (inf): left out
                meter.add(result.samples, loss if result.finite else None,
                          result.grad_norm if result.stepped else None, result.finite_flag)
                if bar:
                    out.progress.step()
                if state.global_step % log_every == 0 or (
                        log_seconds and time.monotonic() - last_log >= log_seconds):
                    self._log_train(out, parts.optimizer, total_steps)
                    last_log = time.monotonic()
                stop, time_due = vote.stop_and_save()
                if stop or state.global_step == stop_at_step:
                    self._stop_if_diverged(self._read_nonfinite())  # counted before the save
                    self._save(parts, periodic=True)
                    say = log.warning if self.runtime.is_main else log.info  # once per job
                    say("stopped at step %d; re-run the same command to resume",
                        state.global_step)
                    return "preempted", results
                if self._checkpoint_due(time_due):
                    self._save(parts, periodic=True)
                if state.global_step >= total_steps:
                    break
                fetched = time.perf_counter()
            done = state.global_step >= total_steps
            end_of_epoch = state.batch_in_epoch == 0  # _count rolled over to the next epoch
            if evaluate and (done or (end_of_epoch and state.epoch % cfg.eval_every_n_epochs == 0)):
                results = evaluate()
        if evaluate and not results:  # resumed a finished run: report it again
            results = evaluate()
        # none pending after a last step; some with a loader shorter than its len()
        self._stop_if_diverged(self._read_nonfinite())
        return "completed", results

    def _count(self, result: Any, parts: Parts, batches: int, per_epoch: int) -> None:
        """Advance the counters, scheduler and EMA after one step (or skipped step)."""
        state = self.state
        state.global_step += 1
        state.batch_in_epoch += batches
        if state.batch_in_epoch >= per_epoch:  # a checkpoint here resumes at the next epoch
            state.epoch += 1
            state.batch_in_epoch = 0
        state.samples_seen += result.samples
        if result.stepped:
            if parts.scheduler is not None:
                parts.scheduler.step()
            if parts.ema is not None:
                parts.ema.update()
        else:
            state.skipped_steps += 1
        if result.finite:
            state.nonfinite_streak = 0
            return
        state.nonfinite_steps += 1
        state.nonfinite_streak += 1
        log.warning("step %d: loss is %s; step skipped (%d in a row)", state.global_step,
                    result.value, state.nonfinite_streak)
        if state.nonfinite_streak >= self.config.nonfinite_patience:
            raise self._diverged(state.nonfinite_streak)

    def _diverged(self, streak: int) -> NonFiniteLossError:
        saved = (f"the last checkpoint, {self.checkpoints.last}, is from step "
                 f"{self._saved_at[0]} and intact"
                 if self.checkpoints is not None and self._saved_at[0] >= 0 else
                 "no checkpoint was written")
        return NonFiniteLossError(
            f"stopped at step {self.state.global_step}: the loss was NaN/inf for "
            f"{streak} steps in a row: lower optim.lr, set "
            "trainer.gradient_clip_val, use bf16-mixed instead of 16-mixed, or check the data",
            details=[saved])

    def _checks_on_host(self, step: int, total_steps: int, stop_at_step: int | None) -> bool:
        """Whether step ``step`` reads its NaN/inf check on the host (and skips a bad step).

        Where the loop waits for the device anyway -- a logging step, a periodic checkpoint, the
        last step -- and at every step while a NaN/inf streak runs, so that
        ``trainer.nonfinite_patience`` counts exactly. Other steps are checked on the device.
        """
        every = self.checkpoint_config.every_n_steps
        return bool(self.state.nonfinite_streak or step % self.config.log_every_n_steps == 0
                    or (every and step % every == 0) or step >= total_steps
                    or step == stop_at_step)

    def _read_nonfinite(self) -> NonFiniteTally:
        """Count the NaN/inf windows the device saw since the last read, into the state.

        A host read (sync) when steps were checked on the device since the last one. Ranks read
        at the same steps and hold the same (all-reduced) tally, so they stop together.
        """
        tally = self._nonfinite.read()
        if not tally.count:
            return tally
        state = self.state
        state.nonfinite_steps += tally.count
        state.skipped_steps += tally.count
        state.nonfinite_streak = tally.streak  # device-checked runs start after a finite step
        log.warning("%d step(s) up to step %d had a NaN/inf loss; their gradients were dropped",
                    tally.count, state.global_step)
        return tally

    def _stop_if_diverged(self, tally: NonFiniteTally) -> None:
        if tally.count and tally.longest >= self.config.nonfinite_patience:
            raise self._diverged(tally.longest)

    def _checkpoint_due(self, time_due: bool) -> bool:
        every = self.checkpoint_config.every_n_steps
        if not (time_due or (every and self.state.global_step % every == 0)):
            return False  # time_due: agreed by all ranks (StepVote)
        # a save never follows NaN/inf steps the host has not counted
        self._stop_if_diverged(self._read_nonfinite())
        # in a NaN/inf streak the weights did not move; keep the last good checkpoint the newest
        return not self.state.nonfinite_streak

    def _time_due(self) -> bool:
        """Whether ``checkpoint.every_n_minutes`` passed since the last save, by rank 0's clock."""
        minutes = self.checkpoint_config.every_n_minutes
        return (bool(minutes) and self.runtime.is_main
                and time.monotonic() - self._saved_at[1] >= 60 * minutes)

    @watched("evaluation")
    def _validate(self, parts: Parts, data: Iterable[Any], writer: Any, criterion: Criterion,
                  metrics: Mapping[str, Any], forward: Forward) -> dict[str, float]:
        """Evaluate (with the EMA weights when on), log, and keep the best checkpoint."""
        with parts.ema.applied() if parts.ema is not None else contextlib.nullcontext():
            results = self.evaluate(parts.model, data, criterion=criterion, metrics=metrics,
                                    forward=forward)
        for name, value in results.items():
            writer.add_scalar(name, value, self.state.global_step)
        log.info("epoch %d step %d %s", self.state.epoch_number, self.state.global_step,
                 " ".join(f"{k} {v:.4f}" for k, v in results.items()))
        if self._improved(results):
            self._save(parts, periodic=False, best=True)
        return results

    def _improved(self, results: Mapping[str, float]) -> bool:
        monitor = self.checkpoint_config.monitor
        if not monitor:
            return False
        if monitor not in results:
            raise TrainkitError(f"checkpoint.monitor={monitor!r} is not a metric of this run; "
                                f"choose one of {', '.join(results)}")
        value, best = results[monitor], self.state.best_metric
        maximize = self.checkpoint_config.mode == "max"
        if best is None or (value > best if maximize else value < best):
            self.state.best_metric = value
            return True
        return False

    # -- internals ----------------------------------------------------------------------------

    @functools.cached_property
    def _manifest(self) -> dict[str, Any]:
        """What produced this run, for its checkpoints: made at the first save (it runs git)."""
        return manifest(self.run_config)

    def _prepare_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.runtime.device)
        if self.config.channels_last:
            model = model.to(memory_format=torch.channels_last)
        if self.config.activation_checkpointing:
            apply_activation_checkpointing(model, self.config.activation_checkpointing)
        distributed.init_process_group(self.runtime)  # no-op in one process or when already up
        return distributed.wrap_ddp(model, self.runtime)

    def _maybe_resume(self, parts: Parts) -> None:
        resume = self.checkpoint_config.resume
        if resume is None or str(resume).lower() in ("null", "none", ""):
            return
        if str(resume) == "auto":
            state = self.checkpoints.load_latest() if self.checkpoints else None
            if state is None:
                return
        else:
            state = load_checkpoint(resume)
        self.load_state_dict(state, parts)
        self._saved_at = (self.state.global_step, time.monotonic())
        at = self.state  # named as step N's log line names it: its epoch, its batch in that epoch
        batch = at.batch_in_epoch or (len(parts.data) if at.epoch else 0)
        log.info("resumed from %s at step %d (epoch %d, batch %d)", state.get("_path", resume),
                 at.global_step, at.epoch_number, batch)

    @watched("checkpoint")
    def _save(self, parts: Parts, *, periodic: bool, best: bool = False) -> None:
        step = self.state.global_step
        if self._saved_at[0] == step and not best:
            return  # already saved at this step (say, a periodic save on the last step)
        # Every rank's RNG state (dropout, augmentation draws differ per rank), for exact resumes.
        rng_per_rank = distributed.gather_to_main(rng.get_rng_state())  # collective: all ranks
        if self.checkpoints is not None and self.runtime.is_main:
            state = self.state_dict(parts)
            if self.runtime.distributed:
                state["rng_per_rank"] = rng_per_rank
            if self._background is not None:  # returns once the state is copied
                self._background.save(state, step, periodic=periodic, best=best)
            else:
                self.checkpoints.save(state, step, periodic=periodic, best=best)
        self._saved_at = (step, time.monotonic())
        barrier()  # no rank runs ahead of a checkpoint still being written (or copied)

    def _log_train(self, out: Outputs, optimizer: torch.optim.Optimizer,
                   total_steps: int) -> None:
        """The window's figures to TensorBoard, the console and train.log."""
        state = self.state
        scalars = out.meter.read()
        scalars["train/lr"] = optimizer.param_groups[0]["lr"]
        scalars["amp/skipped_steps"] = state.skipped_steps
        if self.precision.scaler is not None:
            scalars["amp/loss_scale"] = self.precision.scaler.get_scale()
        for tag, value in scalars.items():
            out.writer.add_scalar(tag, value, state.global_step)
        out.progress.show(scalars["train/loss"], scalars["throughput/samples_per_s"])
        memory = scalars.get("memory/cuda_peak_allocated_gib", scalars["memory/cpu_rss_gib"])
        log.info("epoch %d step %d/%d loss %.4f lr %.3g %.0f samples/s data wait %.0f%% "
                 "mem %.2f GiB", state.epoch_number, state.global_step, total_steps,
                 scalars["train/loss"], scalars["train/lr"],
                 scalars["throughput/samples_per_s"], scalars["time/data_wait_pct"], memory)

    def _write_summary(self, status: str, results: dict[str, float], started: float,
                       begin: tuple[int, int], meter: StepMeter, **extra: Any) -> dict[str, Any]:
        wall = time.perf_counter() - started
        state = self.state
        (samples_at_start, step_at_start) = begin
        steps = state.global_step - step_at_start
        summary = {
            "status": status,
            "metrics": results,
            "global_step": state.global_step,
            "epoch": state.epoch,
            "skipped_steps": state.skipped_steps,
            "nonfinite_steps": state.nonfinite_steps,
            "wall_time_s": wall,
            # this process's own work: a resumed run does not count what came before (and the
            # wall time includes evaluation and checkpointing)
            "samples_per_s": (state.samples_seen - samples_at_start) * self.runtime.world_size
                             / wall if wall else 0.0,
            "steps_per_s": steps / wall if wall else 0.0,
            "world_size": self.runtime.world_size,
            "peak_memory": meter.peaks(),
            **extra,
        }
        if self.run_dir is not None and self.runtime.is_main:
            write_summary(self.run_dir, summary)
        return summary


def _check_schedule_length(scheduler: Any, total_steps: int) -> None:
    """A resumed one-cycle schedule cannot stretch to a new step budget: say so before training."""
    planned = getattr(scheduler, "total_steps", None)
    if isinstance(planned, int) and planned < total_steps:
        raise TrainkitError(
            f"the LR schedule was planned for {planned} steps but this run takes {total_steps}: "
            "keep trainer.max_steps/max_epochs as they were when resuming, or start a new run "
            "(another hydra.run.dir, or checkpoint.resume=null)"
        )


def _state_of(obj: Any) -> Any:
    return obj.state_dict() if obj is not None and hasattr(obj, "state_dict") else None


def _batch_text(data: Any, accumulate: int, world_size: int) -> str:
    size = getattr(data, "batch_size", None)
    if not isinstance(size, int):
        return f"accumulating {accumulate} batches per step"
    return (f"global batch {size * accumulate * world_size} = batch {size} x accumulate "
            f"{accumulate} x world size {world_size}")
