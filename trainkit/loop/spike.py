"""Loss-spike rollback (``trainer.spike``): a spike sends the run back to its last good state.

A :class:`SpikeDetector` calls a loss a spike when it is above the mean + k standard deviations
of the last ``window`` finite losses, or after ``max_nonfinite`` NaN/inf losses in a row. The
:class:`SpikeGuard` keeps a CPU snapshot of every checkpointed part and the RNG every
``snapshot_every`` steps; when the ranks agree on a spike (the step's vote), each loads it, goes
on past the batches trained since (counted as skipped steps: ``global_step`` still names a data
position) and lowers the LR for a few steps. On a GPU a loss is read a step late, so the host
never waits for the step it queued; snapshot and checkpoint steps read their own, so neither
holds a spike. The detector's state is in checkpoints, the snapshot is not (docs/spikes.md).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from trainkit.config import SpikeConfig
from trainkit.core import rng
from trainkit.core.errors import TrainkitError
from trainkit.core.tree import tree_map
from trainkit.data.loader.resumable import ResumableData
from trainkit.distributed import group

log = logging.getLogger("trainkit")
# the Checkpointer's parts (a fit of several models: also each by name)
_RESTORED = ("model", "optimizer", "scheduler", "precision", "ema", "models", "optimizers",
             "schedulers")
# Device types whose losses are read a step late (the tests add "cpu" to run that path there)
LATE_READS = frozenset({"cuda"})


class LossSpikeError(TrainkitError):
    """More loss spikes than ``trainer.spike.max_rollbacks`` within ``rollback_window`` steps."""


class SpikeDetector:
    """Says whether a loss is a spike, given the losses before it; its state is a plain dict
    (in the loop's state, so in every checkpoint).

    Example:
        >>> detector = SpikeDetector(SpikeConfig(window=4, warmup=4, threshold=3.0))
        >>> [detector.observe(x) for x in (1.0, 1.1, 0.9, 1.0, 50.0)][-1]
        'loss 50 above mean 1 + 3 std (0.0707)'
    """

    def __init__(self, config: SpikeConfig, state: dict[str, Any] | None = None) -> None:
        self.config = config
        self.state = state if state is not None else new_state()

    def observe(self, loss: float) -> str | None:
        """Add one step's loss; return why it is a spike (then it is not added), else None."""
        state, config = self.state, self.config
        if not math.isfinite(loss):
            state["streak"] += 1
            if config.max_nonfinite and state["streak"] >= config.max_nonfinite:
                return f"loss {loss} for {state['streak']} steps in a row"
            return None
        state["streak"] = 0
        losses = state["losses"]
        if state["seen"] >= config.warmup:
            n = len(losses)
            mean = state["sum"] / n
            # at least a thousandth of the mean: a flat loss does not make every wiggle a spike
            # (and the running sums' rounding, far below that, does not matter)
            std = max(math.sqrt(max(state["sumsq"] / n - mean * mean, 0.0)), 1e-3 * abs(mean))
            if loss > mean + config.threshold * std:
                return (f"loss {loss:.4g} above mean {mean:.4g} + {config.threshold:g} std "
                        f"({std:.3g})")
        self._add(loss)
        return None

    def _add(self, loss: float) -> None:
        """Into the window and its running sums (O(1) a step; summed anew once a window, so
        that rounding never accumulates)."""
        state, losses = self.state, self.state["losses"]
        losses.append(loss)
        state["sum"] += loss
        state["sumsq"] += loss * loss
        if len(losses) > self.config.window:
            old = losses.pop(0)
            state["sum"] -= old
            state["sumsq"] -= old * old
        state["seen"] += 1
        if state["seen"] % self.config.window == 0:
            state["sum"] = math.fsum(losses)
            state["sumsq"] = math.fsum(x * x for x in losses)


def new_state() -> dict[str, Any]:
    """The guard's part of the loop's state: the detector's window, the NaN/inf streak, the
    step up to which the LR is lowered, and every rollback so far."""
    return {"losses": [], "sum": 0.0, "sumsq": 0.0, "seen": 0, "streak": 0, "lr_until": 0,
            "rollbacks": []}


class _LateLoss:
    """A GPU's losses to the host one step late: each copied to pinned memory without blocking
    (its event recorded), the previous one read -- done by then, so the host waits for nothing."""

    def __init__(self, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self._slots = [(torch.empty((), pin_memory=cuda), torch.cuda.Event() if cuda else None)
                       for _ in range(2)]
        self._queued: list[int] = []  # slots copied to, not yet read, oldest first

    def put(self, step: int, loss: torch.Tensor) -> None:
        buffer, event = self._slots[step % 2]
        buffer.copy_(loss.detach().float(), non_blocking=True)
        if event is not None:
            event.record()
        self._queued.append(step % 2)

    def take(self, keep: int = 0) -> list[float]:
        """The losses queued, oldest first, but the newest ``keep`` (read after their copy)."""
        cut = len(self._queued) - keep
        ready, self._queued = self._queued[:cut], self._queued[cut:]
        values = []
        for slot in ready:
            buffer, event = self._slots[slot]
            if event is not None:
                event.synchronize()  # done long ago unless it is the step just queued
            values.append(buffer.item())
        return values

    def clear(self) -> None:
        self._queued = []


class SpikeGuard:
    """Snapshots the good state and rolls back on a spike; the loop asks it after every step.

    Args:
        config: ``trainer.spike``.
        state: the loop's state (:class:`~trainkit.loop.train_state.TrainState`); the guard's
            own part is its ``spike`` dict, and it counts undone steps in ``skipped_steps``.
        parts: the Checkpointer's registered parts (``model``, ``optimizer``, ...).
        device: where the loss is (on a CUDA device it is read a step late).
        batches_per_epoch: the loader's length, to count the batches a rollback skips.
        sinks: metrics.jsonl and TensorBoard (each rollback's figures); ``log(metrics, step)``.
        is_main: rank 0 says each rollback as a warning (the others in their logs only).
        saves: whether a step gets a periodic checkpoint (the Checkpointer's ``due``).
        total_steps: the fit's last step (its final checkpoint is a save like any other).
    """

    def __init__(self, config: SpikeConfig, state: Any, parts: Mapping[str, Any],
                 device: torch.device, batches_per_epoch: int, sinks: Any,
                 is_main: bool = True, saves: Callable[[int], bool] = lambda step: False,
                 total_steps: int | None = None, restarts_data: bool = True) -> None:
        self.config, self.state, self.parts, self._saves = config, state, parts, saves
        self.total_steps = total_steps
        # a loader that resumes mid-epoch starts a new pass from the state's position after a
        # rollback; any other goes on with the next batch of the pass in flight (the same one)
        self.restarts_data = restarts_data
        if state.spike is None:  # a new run, or one resumed from a checkpoint made without
            state.spike = new_state()
        self.detector = SpikeDetector(config, state.spike)
        self.batches_per_epoch, self.sinks, self.is_main = batches_per_epoch, sinks, is_main
        device = torch.device(device)
        self._late = _LateLoss(device) if device.type in LATE_READS else None
        self._why: str | None = None  # the spike seen and not yet acted on
        self._loss = float("nan")
        self._snapshot: dict[str, Any] = {}
        self.take_snapshot()  # the state the fit starts from is good

    # -- every step ---------------------------------------------------------------------------

    def wrap(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """The loop's step with its loss observed and, after a rollback, the LR lowered."""
        return _GuardedStep(step, self)

    def pending(self) -> bool:
        """Whether this rank saw a spike not acted on yet (the ranks' vote asks)."""
        return self._why is not None

    def observe(self, step: int, result: Any) -> None:
        """Step ``step``'s result (a :class:`~trainkit.loop.step.StepResult`): its loss read
        now (CPU: free), or a step late (CUDA), or now with a sync (other devices)."""
        if self._late is not None:
            self._late.put(step, result.loss)
            for value in self._late.take(keep=1):
                self._see(value)
            return
        value = result.value if result.value is not None else float(result.loss)  # sync off CPU
        self._see(value)

    def _see(self, value: float) -> None:
        if self._why is None:  # after a spike, the losses until the rollback are not counted
            self._why, self._loss = self.detector.observe(value), value

    def after_step(self, step: int, agreed: bool, nonfinite: Any, saving: bool = False) -> bool:
        """Roll back when the ranks agreed on a spike (``agreed``); else snapshot when due.
        True when the run rolled back and its loader starts a new pass from the state's position
        (a plain loader's pass goes on instead: False).

        ``nonfinite``: the loop's :class:`~trainkit.loop.nonfinite.NonFiniteGuard`, whose
        streak a rollback ends. ``saving``: the run stops or saves after this step (a
        checkpoint); every rank must pass the same. The fit's last step saves too.
        """
        saving = saving or (self.total_steps is not None and step >= self.total_steps)
        snapshot = not step % self.config.snapshot_every
        if not (agreed or snapshot or saving or self._saves(step)):
            return False
        if not agreed:  # a snapshot or a checkpoint: this step's own loss read and agreed on
            for value in self._late.take() if self._late is not None else ():
                self._see(value)
            agreed = group.any_rank(self.pending())[0]  # a collective at these steps only
        if agreed:
            self._roll_back(step, nonfinite)
            return self.restarts_data
        if snapshot:
            self.take_snapshot()
        return False

    # -- snapshot and rollback ----------------------------------------------------------------

    def take_snapshot(self) -> None:
        """Copy the good state to CPU memory: every part's ``state_dict``, the RNG, the
        detector, the step and the data position."""
        state = self.state
        parts = {name: _copy(self.parts[name].state_dict()) for name in _RESTORED
                 if self.parts.get(name) is not None}
        self._snapshot = {"parts": parts, "rng": rng.get_rng_state(),  # new objects: no copy
                          "detector": _copy({k: v for k, v in state.spike.items()
                                             if k not in ("lr_until", "rollbacks")}),
                          "step": state.global_step,
                          "position": (state.epoch, state.batch_in_epoch)}

    def _roll_back(self, step: int, nonfinite: Any) -> None:
        """Load the snapshot; count, log and record the rollback; raise when too many."""
        state, snap, config = self.state, self._snapshot, self.config
        # every rank's spike, for the record all ranks keep alike (rollbacks are rare)
        seen = [s for s in group.all_gather((self._why, self._loss)) if s[0] is not None]
        why, loss = seen[0] if seen else ("a spike on another rank", float("nan"))
        recent = [r for r in state.spike["rollbacks"] if r["step"] > step - config.rollback_window]
        if len(recent) >= config.max_rollbacks:
            raise LossSpikeError(
                f"stopped at step {step}: {why}, after {len(recent)} rollback(s) in the last "
                f"{config.rollback_window} steps (trainer.spike.max_rollbacks="
                f"{config.max_rollbacks}): lower optim.lr, set trainer.gradient_clip_val, or "
                "check the data")
        for name, saved in snap["parts"].items():
            self.parts[name].load_state_dict(_copy(saved))
        rng.set_rng_state(snap["rng"])  # copied into the generators
        nonfinite.reset()  # NaN/inf losses of the steps undone are counted; their streak ended
        state.spike.update(_copy(snap["detector"]))
        state.skipped_steps += step - snap["step"]
        state.spike["lr_until"] = step + config.lr_steps
        record = {"step": step, "loss": loss, "reason": why, "to_step": snap["step"],
                  "skipped": [*snap["position"], state.epoch, state.batch_in_epoch],
                  "batches": self._batches_between(snap["position"])}
        state.spike["rollbacks"].append(record)
        self._why = None
        if self._late is not None:
            self._late.clear()  # losses of steps undone
        self._say(record)

    def _batches_between(self, start: tuple[int, int]) -> int:
        """Batches from the position ``start`` to the state's."""
        epochs = self.state.epoch - start[0]
        return epochs * self.batches_per_epoch + self.state.batch_in_epoch - start[1]

    def _say(self, record: dict[str, Any]) -> None:
        epoch, batch, to_epoch, to_batch = record["skipped"]
        lowered = (f"; lr x{self.config.lr_factor:g} for {self.config.lr_steps} steps"
                   if self.config.lr_steps and self.config.lr_factor != 1 else "")
        (log.warning if self.is_main else log.info)(
            "step %d: %s: rolled back to step %d, %d batch(es) skipped (epoch %d batch %d to "
            "epoch %d batch %d)%s", record["step"], record["reason"], record["to_step"],
            record["batches"], epoch + 1, batch, to_epoch + 1, to_batch, lowered)
        self.sinks.log({"spike/rollbacks": len(self.state.spike["rollbacks"]),
                        "spike/loss": record["loss"], "spike/to_step": record["to_step"],
                        "spike/skipped_batches": record["batches"]}, record["step"])

    # -- the LR after a rollback --------------------------------------------------------------

    def lr_factor(self, step: int) -> float:
        """The factor on the LR of step ``step``: ``lr_factor`` in the steps after a rollback."""
        return self.config.lr_factor if step <= self.state.spike["lr_until"] else 1.0


class _GuardedStep:
    """The loop's step (a :class:`~trainkit.loop.step.WindowStep` or its micro-batching), its
    loss given to the guard and, after a rollback, run at a lowered LR (restored before the
    LR schedule steps, so that any scheduler goes on from the planned value)."""

    def __init__(self, step: Callable[..., Any], guard: SpikeGuard) -> None:
        self._step, self._guard = step, guard

    def __call__(self, window: Any, *args: Any) -> Any:
        guard = self._guard
        step = guard.state.global_step + 1
        if step > guard.state.spike["lr_until"]:  # the common case: the LR as planned
            result = self._step(window, *args)
        else:
            result = self._lowered(step, window, *args)
        guard.observe(step, result)
        return result

    def _lowered(self, step: int, window: Any, *args: Any) -> Any:
        factor = self._guard.lr_factor(step)
        groups = self._guard.parts["optimizer"].param_groups
        planned = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] = g["lr"] * factor
        try:
            return self._step(window, *args)
        finally:
            for g, lr in zip(groups, planned):
                g["lr"] = lr

    def __getattr__(self, name: str) -> Any:  # the wrapped step's (its scalars, optimizer, ...)
        return getattr(self._step, name)


def _copy(tree: Any) -> Any:
    """A snapshot of ``tree``: its tensors copied to the CPU (a sharded DTensor's shard stays
    where it is, each rank keeping its own), its containers new."""
    def copy(t: torch.Tensor) -> torch.Tensor:
        if hasattr(t, "to_local"):  # a DTensor (FSDP2): its own copy, placed as it is
            return t.detach().clone()
        return t.detach().to("cpu", copy=True)

    return tree_map(copy, tree, share=False)


def spike_guard(config: SpikeConfig, state: Any, checkpointer: Any, run: Any,
                runtime: Any) -> SpikeGuard | None:
    """The fit's guard when ``trainer.spike.enabled`` (None when off: nothing per step), for
    ``checkpointer``'s parts and periodic saves, ``run``'s loader (any: one that resumes
    mid-epoch starts a new pass after a rollback, another goes on with its next batch) and
    sinks, and ``runtime``'s device."""
    if not config.enabled:
        return None
    return SpikeGuard(config, state, checkpointer.parts, runtime.device, len(run.data),
                      run.report.sinks, runtime.is_main, saves=checkpointer.due,
                      restarts_data=isinstance(run.data, ResumableData))
