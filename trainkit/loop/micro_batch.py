"""Micro-batches: each batch split into smaller ones that accumulate into the same optimizer step,
of a fixed size (``trainer.micro_batch_size=16``) or found on out-of-memory (``=auto``).

The data's batch stays the global per-rank batch: the step's micro-batches are weighted by their
share of its samples (:class:`~trainkit.loop.step.WindowStep`), so the gradient, and with it the
run's math, is the same whatever the split. With ``auto`` a step starts with the whole batch; on
a CUDA out-of-memory error it lets go of what the step held, halves the micro-batch and runs the
same step again. Under DDP every rank takes part in a vote after each micro-batch's backward (did
any rank run out?) and all move to the same size. The size found is kept in the checkpoint
(``TrainState.micro_batch_size``) and summary.json, and a resumed run starts from it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainkit.core.errors import TrainkitError
from trainkit.core.tree import tree_map
from trainkit.distributed import group
from trainkit.distributed.ddp import sync_gradients
from trainkit.loop import oom
from trainkit.loop.step import Batch, StepResult, WindowStep, batch_size

log = logging.getLogger("trainkit")


def split(batch: Batch, size: int) -> list[Batch]:
    """``batch`` as micro-batches of ``size`` samples (the last may be smaller): every tensor
    whose leading size is the batch's is sliced along it (views, no copy); the rest is shared."""
    total = batch_size(batch)
    if size >= total:
        return [batch]

    def part(start: int) -> Batch:
        return tree_map(lambda t: t[start:start + size] if t.ndim and t.shape[0] == total else t,
                        batch)

    return [part(start) for start in range(0, total, size)]


class _PeerOutOfMemory(Exception):
    """Another rank ran out of memory in this step: this one drops its step too."""


def micro_batched(step: WindowStep, config: Any, state: Any, model: Any,
                  profilers: Sequence[Any] = ()) -> WindowStep | MicroBatching:
    """``step`` as ``config.micro_batch_size`` asks (a :class:`TrainerConfig`): itself when
    null, else a :class:`MicroBatching` of it (``profilers``: the first one's memory snapshot at
    each out-of-memory error auto recovers from)."""
    if config.micro_batch_size is None:
        return step
    check_strategy(model, config.micro_batch_size)
    return MicroBatching(step, config.micro_batch_size, state, compiled=config.compile,
                         on_oom=profilers[0].out_of_memory if profilers else None)


class MicroBatching:
    """A :class:`WindowStep` whose batches are split into micro-batches, retried on OOM in auto.

    Args:
        step: the step to run on the split windows.
        setting: ``"auto"`` or a fixed number of samples per micro-batch.
        state: the run's :class:`~trainkit.loop.train_state.TrainState`: its
            ``micro_batch_size`` (0: the whole batch) is where auto starts and what it records.
        compiled: the model is compiled (a new micro-batch shape recompiles it: said once).
        on_oom: called with each out-of-memory error auto recovers from (a memory snapshot).
    """

    def __init__(self, step: WindowStep, setting: int | str, state: Any, *,
                 compiled: bool = False,
                 on_oom: Callable[[BaseException], None] | None = None) -> None:
        self.step, self.auto, self.state = step, setting == "auto", state
        self.compiled, self.on_oom = compiled, on_oom
        if not self.auto:
            state.micro_batch_size = int(setting)
        # auto under DDP: no rank's backward all-reduces until all said they did not run out
        self.vote = self.auto and group.is_distributed()
        if self.vote:
            step.after_backward = self._agree_and_reduce
        if state.micro_batch_size:
            log.info("micro-batches of %d samples%s", state.micro_batch_size,
                     " (found by auto before the resume)" if self.auto else "")

    def wrap_forward_once(self, wrap: Callable[[Any], Any]) -> None:
        """The step's: the advice's sampling of one forward reaches the micro-batches too."""
        self.step.wrap_forward_once(wrap)

    def __call__(self, window: Sequence[Batch], check_finite: bool = False,
                 guard_finite: bool = False) -> StepResult:
        """One optimizer step over ``window``, its batches split; in auto, until it fits."""
        while True:
            size = self.state.micro_batch_size
            parts = [p for batch in window for p in split(batch, size)] if size else window
            try:
                if self.vote:
                    with sync_gradients(self.step.model, sync=False):
                        return self.step(parts, check_finite, guard_finite)
                return self.step(parts, check_finite, guard_finite)
            except (torch.cuda.OutOfMemoryError, _PeerOutOfMemory) as err:
                if not self.auto:
                    raise
                mine = isinstance(err, torch.cuda.OutOfMemoryError)
                if mine and self.on_oom is not None:
                    self.on_oom(err)
                oom.release(err, self.step.optimizer)
                if self.vote and mine:  # the others wait in the vote after their backward
                    group.any_rank(True)
                self._halve(window, size, err if mine else None)

    def _halve(self, window: Sequence[Batch], size: int, error: BaseException | None) -> None:
        """The next, smaller size, the same on every rank; at one sample: the OOM, raised."""
        current = size or max(batch_size(b) for b in window)
        smaller = min(group.all_gather(current // 2))  # every rank moves to the same size
        if smaller < 1:
            if error is not None:
                raise error
            raise torch.cuda.OutOfMemoryError(
                "CUDA out of memory on another rank at a micro-batch of 1 sample")
        self.state.micro_batch_size = smaller
        log.warning("out of memory at step %d with micro-batches of %d: the same step again with "
                    "micro-batches of %d (the global batch is unchanged)%s",
                    self.state.global_step + 1, current, smaller,
                    "; the compiled model recompiles for the new shape" if self.compiled else "")

    def _agree_and_reduce(self, last: bool) -> None:
        """After each micro-batch's backward: did any rank run out? After the last, if none
        did, average the gradients over the ranks (DDP's own all-reduce was held back: a rank
        out of memory would never have joined it). A vote per micro-batch keeps the ranks'
        collectives in step: DDP broadcasts buffers (batch-norm statistics) at each forward,
        which a rank that stopped at an earlier micro-batch would not join."""
        if group.any_rank(False)[0]:
            raise _PeerOutOfMemory
        if not last:
            return
        grads = [p.grad for p in self.step.model.parameters() if p.grad is not None]
        works = [dist.all_reduce(g, async_op=True) for g in grads]
        for work in works:
            work.wait()
        torch._foreach_div_(grads, dist.get_world_size())


def check_strategy(model: nn.Module, setting: int | str | None) -> None:
    """auto's retry averages gradients itself: with DDP or one process, not FSDP's shards."""
    from trainkit.distributed import fsdp

    if setting == "auto" and fsdp.is_sharded(model):
        raise TrainkitError("trainer.micro_batch_size=auto does not work with "
                            "trainer.strategy=fsdp: set a number of samples instead")
