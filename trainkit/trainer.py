"""The training loop, assembled from trainkit's parts.

``global_step`` counts optimizer steps attempted: one per accumulation window, including the
rare fp16 steps the GradScaler skips because gradients overflowed (those are counted in
``skipped_steps`` and do not advance the LR scheduler). ``trainer.max_steps`` therefore bounds
the data consumed, and a checkpoint's step number always names the same position in the data.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainkit import rng
from trainkit.activations import apply_activation_checkpointing
from trainkit.checkpoint import CheckpointManager, load_checkpoint
from trainkit.config import CheckpointConfig, TrainerConfig
from trainkit.device import move_to_device
from trainkit.distributed import barrier, unwrap
from trainkit.errors import TrainkitError
from trainkit.logging import make_writer, setup_logging
from trainkit.metrics import DeviceMean
from trainkit.precision import Precision
from trainkit.runtime import Runtime
from trainkit.step import Criterion, Forward, batch_size, default_forward, train_window, windows

log = logging.getLogger("trainkit")


@dataclass
class TrainState:
    """Where the loop is; saved in every checkpoint."""

    global_step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of `epoch` already trained on
    samples_seen: int = 0
    skipped_steps: int = 0


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
    ) -> dict[str, Any]:
        """Train until ``max_epochs`` or ``max_steps``, evaluating each epoch; return the summary.

        ``train_data`` is any iterable of batches with a length (a DataLoader, an
        :class:`~trainkit.data.InMemoryLoader`, ...); when it has ``set_epoch`` it is called every
        epoch. ``forward(model, batch)`` returns ``(outputs, targets)`` for ``criterion`` and the
        torchmetrics ``metrics``, which are reported as ``val/<name>``.
        """
        cfg = self.config
        device = self.runtime.device
        model = self._prepare_model(model)
        started = time.perf_counter()
        self._maybe_resume(model, optimizer, scheduler)
        steps_per_epoch = math.ceil(len(train_data) / cfg.accumulate_grad_batches)
        total_steps = self.planned_steps(len(train_data))
        writer = make_writer(self.run_dir, self.runtime.is_main)
        train_model = torch.compile(model) if cfg.compile else model
        log.info("training %s on %s for %d steps (%d per epoch), precision %s, %s",
                 type(unwrap(model)).__name__, device, total_steps, steps_per_epoch,
                 cfg.precision, _batch_text(train_data, cfg.accumulate_grad_batches,
                                            self.runtime.world_size))

        metrics = {name: m.to(device) for name, m in (metrics or {}).items()}
        results: dict[str, float] = {}
        loss_mean = DeviceMean()  # read (one sync) only at log steps
        state = self.state
        samples_at_start = state.samples_seen
        window_start, samples_at_window = time.perf_counter(), state.samples_seen
        done = state.global_step >= total_steps
        while not done and state.epoch < cfg.max_epochs:
            _set_epoch(train_data, state.epoch, state.batch_in_epoch)
            model.train()
            for window in windows(train_data, cfg.accumulate_grad_batches):
                result = train_window(
                    train_model, window, optimizer=optimizer, precision=self.precision,
                    criterion=criterion, forward=forward, device=device,
                    clip_val=cfg.gradient_clip_val, clip_algorithm=cfg.gradient_clip_algorithm,
                )
                if result.stepped:
                    if scheduler is not None:
                        scheduler.step()
                else:
                    state.skipped_steps += 1
                state.global_step += 1
                state.batch_in_epoch += len(window)
                state.samples_seen += result.samples
                loss_mean.add(result.loss)
                if state.global_step % cfg.log_every_n_steps == 0:
                    now = time.perf_counter()
                    self._log_train(writer, optimizer, loss_mean.pop(),
                                    (state.samples_seen - samples_at_window) / (now - window_start),
                                    total_steps)
                    window_start, samples_at_window = now, state.samples_seen
                every = self.checkpoint_config.every_n_steps
                if every and state.global_step % every == 0:
                    self._save(model, optimizer, scheduler, periodic=True)
                if state.global_step >= total_steps:
                    break
            end_of_epoch = state.batch_in_epoch >= len(train_data)
            if end_of_epoch:
                state.epoch += 1
                state.batch_in_epoch = 0
            done = state.global_step >= total_steps
            due = done or (end_of_epoch and state.epoch % cfg.eval_every_n_epochs == 0)
            if val_data is not None and due:
                results = self._validate(model, val_data, writer, criterion, metrics, forward)
        if val_data is not None and not results:  # resumed a finished run: report it again
            results = self._validate(model, val_data, writer, criterion, metrics, forward)
        wall = time.perf_counter() - started
        if self.checkpoint_config.save_last:
            periodic = bool(self.checkpoint_config.every_n_steps)
            self._save(model, optimizer, scheduler, periodic=periodic)
        summary = {
            "status": "completed",
            "metrics": results,
            "global_step": state.global_step,
            "epoch": state.epoch,
            "skipped_steps": state.skipped_steps,
            "wall_time_s": wall,
            # this process's own work: a resumed run does not count what came before
            "samples_per_s": (state.samples_seen - samples_at_start) * self.runtime.world_size
                             / wall if wall else 0.0,
            "world_size": self.runtime.world_size,
        }
        self._write_summary(summary)
        writer.close()
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
        results = {"val/loss": loss_sum.item() / max(count, 1)}
        results.update({f"val/{name}": float(m.compute()) for name, m in metrics.items()})
        model.train(was_training)
        return results

    def _validate(self, model: nn.Module, data: Iterable[Any], writer: Any, criterion: Criterion,
                  metrics: Mapping[str, Any], forward: Forward) -> dict[str, float]:
        """Evaluate, then write the results to TensorBoard and the log."""
        results = self.evaluate(model, data, criterion=criterion, metrics=metrics, forward=forward)
        for name, value in results.items():
            writer.add_scalar(name, value, self.state.global_step)
        log.info("epoch %d step %d %s", self.state.epoch, self.state.global_step,
                 " ".join(f"{k} {v:.4f}" for k, v in results.items()))
        return results

    def planned_steps(self, batches_per_epoch: int) -> int:
        """Optimizer steps this run will take: the smaller of the epoch and step limits."""
        per_epoch = math.ceil(batches_per_epoch / self.config.accumulate_grad_batches)
        by_epochs = per_epoch * self.config.max_epochs
        return by_epochs if self.config.max_steps < 0 else min(by_epochs, self.config.max_steps)

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                   scheduler: Any = None) -> dict[str, Any]:
        """Everything a checkpoint holds, each part asked for its own state."""
        return {
            "model": unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "precision": self.precision.state_dict(),
            "trainer": asdict(self.state),
            "global_step": self.state.global_step,
            "epoch": self.state.epoch,
            "rng": rng.get_rng_state(),
            "config": self.run_config,
            "versions": {"torch": str(torch.__version__), "cuda": torch.version.cuda},
        }

    # -- internals ----------------------------------------------------------------------------

    def _prepare_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.runtime.device)
        if self.config.channels_last:
            model = model.to(memory_format=torch.channels_last)
        if self.config.activation_checkpointing:
            apply_activation_checkpointing(model, self.config.activation_checkpointing)
        return model

    def _maybe_resume(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                      scheduler: Any) -> None:
        resume = self.checkpoint_config.resume
        if resume is None or str(resume).lower() in ("null", "none", ""):
            return
        if str(resume) == "auto":
            state = self.checkpoints.load_latest() if self.checkpoints else None
            if state is None:
                return
        else:
            state = load_checkpoint(resume)
        self.load_state_dict(state, model, optimizer, scheduler)
        log.info("resumed from %s at step %d (epoch %d, batch %d)", state.get("_path", resume),
                 self.state.global_step, self.state.epoch, self.state.batch_in_epoch)

    def load_state_dict(self, state: Mapping[str, Any], model: nn.Module,
                        optimizer: torch.optim.Optimizer, scheduler: Any = None) -> None:
        """Restore a checkpoint made by :meth:`state_dict` into these objects."""
        saved_model = state.get("config", {}).get("model")
        if saved_model and self.run_config.get("model") and saved_model != self.run_config["model"]:
            raise TrainkitError(
                f"checkpoint {state.get('_path', '')} is of model {saved_model}, this run builds "
                f"{self.run_config['model']}: use another run dir or checkpoint.resume=null"
            )
        try:
            unwrap(model).load_state_dict(state["model"])
        except RuntimeError as err:
            first = str(err).strip().splitlines()
            raise TrainkitError(f"checkpoint does not fit this model: {' '.join(first[:2])}"
                                ) from None
        optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None and state.get("scheduler") is not None:
            scheduler.load_state_dict(state["scheduler"])
        self.precision.load_state_dict(state["precision"])
        self.state = TrainState(**state["trainer"])
        rng.set_rng_state(state["rng"])

    def _save(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
              *, periodic: bool) -> None:
        if self.checkpoints is not None and self.runtime.is_main:
            self.checkpoints.save(self.state_dict(model, optimizer, scheduler),
                                  self.state.global_step, periodic=periodic)
        barrier()  # no rank runs ahead of a checkpoint still being written

    def _log_train(self, writer: Any, optimizer: torch.optim.Optimizer, loss: float,
                   samples_per_s: float, total_steps: int) -> None:
        step = self.state.global_step
        lr = optimizer.param_groups[0]["lr"]
        writer.add_scalar("train/loss", loss, step)
        writer.add_scalar("train/lr", lr, step)
        writer.add_scalar("throughput/samples_per_s", samples_per_s, step)
        log.info("epoch %d step %d/%d loss %.4f lr %.3g %.0f samples/s",
                 self.state.epoch, step, total_steps, loss, lr, samples_per_s)

    def _write_summary(self, summary: dict[str, Any]) -> None:
        if self.run_dir is None or not self.runtime.is_main:
            return
        path = self.run_dir / "summary.json"
        tmp = path.with_name(".summary.json.tmp")
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(path)


def _set_epoch(data: Any, epoch: int, start_batch: int) -> None:
    """Point the loader at an epoch (and, when resuming, a batch inside it)."""
    if hasattr(data, "set_epoch"):
        try:
            data.set_epoch(epoch, start_batch)
            return
        except TypeError:  # a set_epoch(epoch) without resume support, e.g. DistributedSampler's
            data.set_epoch(epoch)
    elif hasattr(getattr(data, "sampler", None), "set_epoch"):
        data.sampler.set_epoch(epoch)
    if start_batch:
        raise TrainkitError(
            f"cannot resume inside an epoch with a {type(data).__name__}: it cannot start at "
            f"batch {start_batch}; use trainkit's loaders or checkpoint at epoch ends"
        )


def _batch_text(data: Any, accumulate: int, world_size: int) -> str:
    size = getattr(data, "batch_size", None)
    if not isinstance(size, int):
        return f"accumulating {accumulate} batches per step"
    return (f"global batch {size * accumulate * world_size} = batch {size} x accumulate "
            f"{accumulate} x world size {world_size}")
