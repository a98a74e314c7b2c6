"""The Checkpointer: what a checkpoint holds, when one is written, and what a run starts from.

The loop registers the stateful parts once (:meth:`Checkpointer.register`) and then only says
what happened -- a step was done (:meth:`~Checkpointer.step_done`), an evaluation gave results
(:meth:`~Checkpointer.evaluated`), the run stops or ends (:meth:`~Checkpointer.save`); the
Checkpointer decides whether to write, and its storage (:mod:`~trainkit.checkpoint.storages`)
how and where. :meth:`~Checkpointer.start` decides where a run starts: ``checkpoint.resume``
restores everything (an extended run re-plans its LR schedule over the new length, with a
warning), else ``checkpoint.init_from`` loads a checkpoint's weights into a fresh run.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from trainkit.checkpoint.adapters import AdaptersOnly
from trainkit.checkpoint.contents import check_config, manifest
from trainkit.checkpoint.layout import newest_readable
from trainkit.checkpoint.location import (
    Folder,
    LocalFolder,
    checkpoint_folder,
    checkpoint_path,
)
from trainkit.checkpoint.storages import Content, Storage, storages_for
from trainkit.config import CheckpointConfig
from trainkit.core import rng, schedules
from trainkit.core.errors import TrainkitError
from trainkit.core.runtime import Runtime
from trainkit.data.loader.resumable import ResumableData
from trainkit.distributed import ddp, group
from trainkit.distributed.watchdog import Watchdog, watched
from trainkit.observe.sinks import tracker_runs

log = logging.getLogger("trainkit")
_POSITION = ("epoch", "batch")  # a loader's state beyond these is its settings (seed, ...)


class LoopState(Protocol):
    """The loop's counters as a checkpoint uses them (:class:`~trainkit.loop.train_state.TrainState`
    is one): saved and restored whole through ``state_dict``, read for log lines and the best
    metric, and moved to another data position when a run resumes on another number of ranks."""

    global_step: int
    epoch: int
    batch_in_epoch: int
    best_metric: float | None
    best_step: int | None
    planned_steps: int

    @property
    def epoch_number(self) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class Checkpointer:
    """Owns the stateful parts of a run and every decision about its checkpoints.

    Args:
        config: when to save, what to keep, what to start from.
        run_dir: checkpoints go to ``<run_dir>/checkpoints``, or to ``checkpoint.dir`` (a path or
            any fsspec URL) where it is set; None (and no ``checkpoint.dir``) writes none.
        runtime: ranks (rank 0 writes; every rank takes part in a save).
        run_config: the run's resolved config, stored in checkpoints and compared on resume.
        watchdog: the hang watchdog, told when a save is in progress.

    Example:
        >>> ckpt = Checkpointer(CheckpointConfig(every_n_steps=100), "runs/a", runtime)
        ... # doctest: +SKIP
        >>> ckpt.register(state, model=model, optimizer=optimizer, precision=precision)
        >>> ckpt.start(planned_steps=1000)
        >>> ckpt.step_done(step)           # after every step: saves when every_n_steps says so
        >>> ckpt.save(step, last_step=True)  # the run completed
    """

    def __init__(self, config: CheckpointConfig, run_dir: str | Path | None, runtime: Runtime,
                 run_config: Mapping[str, Any] | None = None,
                 watchdog: Watchdog | None = None) -> None:
        self.config = config
        self.runtime = runtime
        self.run_config = dict(run_config or {})
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.where = _where(config.dir, self.run_dir)
        # Path | str | None: where the checkpoints go, as the storages name them
        self.directory = (self.where.directory if isinstance(self.where, LocalFolder)
                          else str(self.where) if self.where is not None else None)
        if self.where is not None and runtime.is_main:  # now, not hours into a run
            self.where.check_writable()
        self._watchdog = watchdog or Watchdog(0)
        self.saved_step, self._saved_time = -1, time.monotonic()
        self._next_due = 0  # the next step step_done() looks at (set by start() and each save)
        self.state: LoopState | None = None  # given by register()
        self.parts: dict[str, Any] = {}
        self.module: nn.Module | None = None  # the model itself (register())
        # the storage this run writes with first, then those it can also read (register())
        self.storages: tuple[Storage, ...] = ()
        # told of every save, on every rank: (path, step) -> None (the callbacks' on_checkpoint)
        self.on_saved: Callable[[Path | None, int], None] | None = None

    def register(self, state: LoopState, *, model: nn.Module, optimizer: Any,
                 precision: Any, scheduler: Any = None, ema: Any = None,
                 data: Any = None, callbacks: Any = None,
                 named: Mapping[str, Any] | None = None) -> None:
        """The objects a checkpoint holds; None for a part this run has not.

        ``callbacks``: the stateful callbacks (a :class:`~trainkit.loop.callbacks.Callbacks`);
        ``named``: more parts by key (a fit of several models: ``models``, ``optimizers``, ...).

        The model chooses the storage (:func:`~trainkit.checkpoint.storages.storages_for`): one
        sharded by ``fully_shard`` (FSDP2) gets directories every rank writes its part of. A
        collective: every rank registers at the same point.
        """
        self.state = state
        self.module = model = ddp.unwrap(model)  # the parts' model: all of it, or its adapters
        self.parts = {"model": AdaptersOnly(model) if self.config.adapters_only else model,
                      "optimizer": optimizer,
                      "scheduler": scheduler, "precision": precision, "ema": ema,
                      "data": data if isinstance(data, ResumableData) else None,
                      "callbacks": callbacks, **(named or {})}
        self.storages = storages_for(model, self.where, self.config, self.runtime)

    @property
    def storage(self) -> Storage:
        """The storage this run's checkpoints are written with."""
        return self.storages[0]

    def state_dict(self, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
        """Everything a checkpoint holds, each part asked for its own state (but ``exclude``)."""
        return {
            **{name: part.state_dict() if part is not None else None
               for name, part in self.parts.items() if name not in exclude},
            "trainer": self.state.state_dict(),
            "global_step": self.state.global_step,
            "epoch": self.state.epoch,
            "rng": rng.get_rng_state(),
            "config": self.run_config,
            # the experiment trackers' runs that this run logs to, once they have started
            "manifest": {**self._manifest, "trackers": tracker_runs(self.run_dir)},
        }

    # -- where the run starts -----------------------------------------------------------------

    def start(self, planned_steps: int) -> None:
        """Resume, or initialize from ``checkpoint.init_from``, or leave the parts as they are.

        ``planned_steps``: the optimizer steps this run takes (its LR schedule's length).
        """
        state = self._checkpoint_to_resume()
        if state is not None:
            self.load_state_dict(state, planned_steps)
        elif self.config.init_from:
            self._init_from(str(self.config.init_from))
        self.state.planned_steps = planned_steps
        self._next_due = self._due_after(self.state.global_step)
        group.check_same_start(self.state.global_step)  # every rank resumed the same step

    def load_state_dict(self, state: Mapping[str, Any], planned_steps: int | None = None) -> None:
        """Restore a checkpoint made by :meth:`state_dict` into the registered parts."""
        check_config(state, self.run_config)
        storage = next(s for s in self.storages if s.holds(state))  # of the checkpoint's format
        if not storage.load(state, self.parts, key="checkpoint.resume", optimizer=True):
            self._restart_ema("checkpoint has no EMA weights: the average starts from here")
        self._load_schedule(state, planned_steps)
        self.parts["precision"].load_state_dict(state["precision"])
        for key in ("models", "optimizers", "schedulers"):  # a fit of several, by name
            if self.parts.get(key) is not None:
                self.parts[key].load_state_dict(state.get(key) or {})
        self._check_data(state.get("data"))
        if self.parts.get("callbacks") is not None:
            self.parts["callbacks"].load_state_dict(state.get("callbacks"))
        self.state.load_state_dict(state["trainer"])
        at, data = self.state, self.parts["data"]
        moved = storage.carry_over(state, at, data)  # may have been saved on another world size
        self.saved_step, self._saved_time = self.state.global_step, time.monotonic()
        # named as step N's log line names it: its epoch (from 1), its batch in that epoch
        batch = at.batch_in_epoch or (len(data) if at.epoch and data is not None else 0)
        log.info("resumed from %s at step %d (epoch %d, batch %d)%s",
                 state.get("_path", self.config.resume), at.global_step, at.epoch_number, batch,
                 moved)

    def _checkpoint_to_resume(self) -> dict[str, Any] | None:
        resume = self.config.resume
        if resume is None or str(resume).lower() in ("null", "none", ""):
            return None
        if str(resume) == "auto":
            return self._latest()
        return self._read(checkpoint_path(resume), "checkpoint.resume")

    def _latest(self) -> dict[str, Any] | None:
        """The newest checkpoint of this run dir, from the storages this run can resume from
        (its own first: a run saved sharded can go on in one process, not the reverse)."""
        for storage in self.storages:
            read = functools.partial(storage.read, key="checkpoint.resume")
            if (state := newest_readable(storage.list(), read)) is not None:
                return state
        return None

    def _read(self, path: Path | str, key: str) -> dict[str, Any]:
        """The checkpoint at ``path``, read by the storage of its format."""
        return next(s for s in self.storages if s.holds(path)).read(path, key)

    def _load_schedule(self, state: Mapping[str, Any], planned_steps: int | None) -> None:
        """The saved schedule as it was; re-planned when the run got longer than it was."""
        scheduler, saved = self.parts["scheduler"], state.get("scheduler")
        if scheduler is None or saved is None:
            return
        was = state["trainer"].get("planned_steps") or saved.get("total_steps") or 0
        if not (was and planned_steps and planned_steps > was):
            scheduler.load_state_dict(saved)
            return
        # An extended run: the fresh scheduler is planned over the new length; bring it to the
        # step the saved one had reached (its LR becomes what a run planned that long has there).
        optimizer = self.parts["optimizer"]
        before = optimizer.param_groups[0]["lr"]
        schedules.advance(scheduler, int(saved.get("last_epoch", state["global_step"])))
        log.warning("this run takes %d steps, its checkpoint's run was planned for %d: the LR "
                    "schedule is re-planned over %d steps from step %d (lr %.3g -> %.3g)",
                    planned_steps, was, planned_steps, state["global_step"], before,
                    optimizer.param_groups[0]["lr"])

    def _restart_ema(self, why: str | None) -> None:
        """Restart the EMA (if any) from the weights now in the model, saying ``why``."""
        if self.parts["ema"] is None:
            return
        self.parts["ema"].restart()
        if why:
            log.warning(why)

    def _check_data(self, saved: Mapping[str, Any] | None) -> None:
        """The position comes from the loop's state; the loader's settings must be the saved."""
        data = self.parts["data"]
        if saved is None or data is None:
            return
        if hasattr(data, "resume_check"):  # a loader that checks its own (an ImageLoader)
            data.resume_check(saved)
            saved = {key: value for key, value in saved.items() if key in data.state_dict()}
        live = data.state_dict()
        changed = [f"{key} {value} -> {live.get(key)}" for key, value in saved.items()
                   if key not in _POSITION and live.get(key) != value]
        if changed:
            raise TrainkitError(f"the data loader differs from the checkpoint's "
                                f"({', '.join(changed)}): the order would differ; resume with "
                                "the same settings (trainer.seed)")

    def _init_from(self, path: str) -> None:
        state = self._read(checkpoint_path(path), "checkpoint.init_from")
        storage = next(s for s in self.storages if s.holds(state))
        has_ema = storage.load(state, self.parts, key="checkpoint.init_from", optimizer=False)
        named, saved = self.parts.get("models"), state.get("models") or {}
        if named is not None:  # a fit of several models: each the checkpoint has, by name
            for name in set(named.parts) & set(saved):
                named.parts[name].load_state_dict(saved[name])
        if not has_ema:
            self._restart_ema(None)  # the average of the loaded weights, not of the random ones
        log.info("initialized the weights from %s (step %d of its run%s); optimizer, LR "
                 "schedule and counters start fresh", path, state["global_step"],
                 ", and its EMA" if has_ema else "")

    # -- when to save -------------------------------------------------------------------------

    def step_done(self, step: int, *, time_due: bool = False,
                  may_save: Callable[[], bool] = lambda: True) -> None:
        """The loop finished step ``step``: save it when ``checkpoint.every_n_steps`` says so or
        ``time_due`` (the ranks' vote on :meth:`time_due`), and ``may_save()`` agrees (the
        loop's NaN/inf guard: no streak running). The loop calls this after every step; most
        steps cost one comparison."""
        if step != self._next_due and not time_due:
            return
        if self.due(step, time_due) and may_save():
            self.save(step)
        else:
            self.storage.poll()  # an async save that ended gets its name and `last` now
        self._next_due = self._due_after(step)

    def due(self, step: int, time_due: bool = False) -> bool:
        """Whether step ``step`` gets a periodic checkpoint (``time_due``: agreed by all ranks)."""
        every = self.config.every_n_steps
        return time_due or bool(every and step % every == 0)

    def time_due(self) -> bool:
        """Whether ``checkpoint.every_n_minutes`` passed since the last save, by rank 0's clock
        (the ranks vote on it, so that all save at the same step)."""
        minutes = self.config.every_n_minutes
        return (bool(minutes) and self.runtime.is_main
                and time.monotonic() - self._saved_time >= 60 * minutes)

    def _due_after(self, step: int) -> int:
        """The next step :meth:`step_done` looks at: the next one ``every_n_steps`` saves at (0:
        none), or the very next while an async save awaits its publication (a sharded one
        does), so that ``last`` points at it as soon as it is on disk."""
        if self.storages and self.storage.in_flight:
            return step + 1
        every = self.config.every_n_steps
        return (step // every + 1) * every if every else 0

    def evaluated(self, results: Mapping[str, float], step: int) -> None:
        """Keep ``best.pt`` when ``checkpoint.monitor`` improved."""
        if self._improved(results):
            self.state.best_step = step
            self.save(step, best=True)

    def best(self) -> dict[str, Any] | None:
        """summary.json's ``best``: ``checkpoint.monitor``'s best value, the step it was
        measured at and the checkpoint kept of it; None without a monitor or a best yet."""
        if not (self.config.monitor and self.storages and self.state is not None
                and self.state.best_step is not None):
            return None
        return {"metric": self.config.monitor, "value": self.state.best_metric,
                "step": self.state.best_step, "path": str(self.storage.best)}

    def _improved(self, results: Mapping[str, float]) -> bool:
        monitor = self.config.monitor
        if not monitor:
            return False
        if monitor not in results:
            raise TrainkitError(f"checkpoint.monitor={monitor!r} is not a metric of this run; "
                                f"choose one of {', '.join(results)}")
        value, best = results[monitor], self.state.best_metric
        maximize = self.config.mode == "max"
        if best is None or (value > best if maximize else value < best):
            self.state.best_metric = value
            return True
        return False

    @watched("checkpoint")
    def save(self, step: int, *, last_step: bool = False, best: bool = False,
             again: bool = False) -> None:
        """Write a checkpoint of step ``step`` (every rank calls this; rank 0 writes).

        ``last_step``: the run completed (written when ``checkpoint.save_last``); ``best``:
        ``best.pt`` too. A second save of the same step is skipped unless ``best`` or ``again`` (the
        state changed since: the run stops by request).
        """
        if ((self.saved_step == step and not (best or again))
                or (last_step and not self.config.save_last)):
            return
        periodic = (self.due(step) if best
                    else bool(self.config.every_n_steps) or not last_step)
        # Ranks' batch-norm statistics (buffers, and the EMA's averages of them) differ: the saved
        # ones are rank 0's, as evaluate() uses. Broadcast rather than averaged: rank 0's are not
        # changed by it, so a save (a preemption's) changes nothing a later evaluation reports,
        # and the model saved is the one behind the metrics (FSDP would save any rank's copy).
        ema = self.parts["ema"]
        ddp.broadcast_buffers(self.module, *(ema.buffers() if ema else ()))
        # Every rank's RNG state (dropout, augmentation draws differ per rank), for exact resumes.
        rng_per_rank = group.gather_to_main(rng.get_rng_state())  # collective: all ranks
        path = self.storage.save(step, Content(self.parts, self.state_dict, rng_per_rank),
                                 periodic=periodic, best=best)  # async: returns once copied
        self.saved_step, self._saved_time = step, time.monotonic()
        self._next_due = self._due_after(step)
        group.barrier()  # no rank runs ahead of a checkpoint still being written (or copied)
        if self.on_saved is not None:
            self.on_saved(path, step)

    def wait(self) -> None:
        """Block until the last checkpoint is on disk (raise its write's error)."""
        if self.storages:
            self.storage.wait()

    def close(self) -> None:
        """Let a write still in flight end whole, however the run ends."""
        if self.storages:
            self.storage.close()

    def release_data(self) -> None:
        """Let go of the run's data once its fit is over: the user's loader, with its worker
        processes, is the user's alone again."""
        self.parts["data"] = None

    def last_saved(self) -> str:
        """Which checkpoint a run that stops on an error leaves, as words for its message."""
        if self.directory is None or self.saved_step < 0:
            return "no checkpoint was written"
        return (f"the last checkpoint, {self.storage.last}, is from step {self.saved_step} and "
                "intact")

    @functools.cached_property
    def _manifest(self) -> dict[str, Any]:
        """What produced this run, for its checkpoints: made at the first save (it runs git)."""
        return manifest(self.run_config)


def _where(configured: str | None, run_dir: Path | None) -> Folder | None:
    """Where the checkpoints go: ``checkpoint.dir`` (a folder or a store's URL), else
    ``<run_dir>/checkpoints``; None: nowhere."""
    if configured:
        return checkpoint_folder(str(configured))
    return checkpoint_folder(run_dir / "checkpoints") if run_dir is not None else None
