"""Micro-batches: each batch split into smaller ones that accumulate into the same optimizer step,
of a fixed size (``trainer.micro_batch_size=16``) or found on out-of-memory (``=auto``).

The micro-batches are weighted by their share of the batch's samples, so the run's math is the
same whatever the split. ``auto`` starts with the whole batch and, on a CUDA out-of-memory
error, releases the step's memory, halves the micro-batch and runs the step again (under DDP
all ranks vote and move together). The size found is in checkpoints and summary.json.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

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

    In auto, an out-of-memory error in a forward, a backward or (in one process) clipping retries
    the step with half the micro-batch. One in ``optimizer.step``, or under DDP after the last
    backward, is not retried (the optimizer or other ranks may have moved on): it ends the run.

    Args:
        step: the step to run on the split windows.
        setting: ``"auto"`` or a fixed number of samples per micro-batch.
        state: the run's :class:`~trainkit.loop.train_state.TrainState`: its
            ``micro_batch_size`` (0: the whole batch) is where auto starts and what it records.
        compiled: the model is compiled (a new micro-batch shape recompiles it: said once).
        on_oom: called with each out-of-memory error auto recovers from, before the memory is
            released (a memory snapshot); the one it gives up on is left to the run's report.
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
        self._phase = _BACKWARD  # how far the step being tried got
        if self.auto:
            step.after_backward = self._after_backward
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
            if not self.auto:
                return self.step(parts, check_finite, guard_finite)
            try:
                result = self._attempt(parts, check_finite, guard_finite)
            except (torch.cuda.OutOfMemoryError, _PeerOutOfMemory) as err:
                self._recover(err, window, size)  # raises what is not retried
                continue
            if self.vote and group.any_rank(False)[0]:  # did a rank run out after its backward?
                raise torch.cuda.OutOfMemoryError(
                    "CUDA out of memory on another rank after its backward (clipping or the "
                    "optimizer step, which are not retried)")
            return result

    def _attempt(self, parts: Sequence[Batch], check_finite: bool,
                 guard_finite: bool) -> StepResult:
        """The step once, its progress followed (``_phase``): the optimizer's step pre-hook
        says when ``optimizer.step`` began, whoever calls it (the step, the loss scaler)."""
        self._phase = _BACKWARD
        hook = self.step.optimizer.register_step_pre_hook(self._stepping)
        try:
            if self.vote:
                with sync_gradients(self.step.model, sync=False):
                    return self.step(parts, check_finite, guard_finite)
            return self.step(parts, check_finite, guard_finite)
        finally:
            hook.remove()

    def _stepping(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._phase = _STEP

    def _recover(self, err: BaseException, window: Sequence[Batch], size: int) -> None:
        """After an out-of-memory error: the same step again with a smaller micro-batch, the
        same on every rank; else the error raised, its memory not yet released, so the run's
        report reads (and snapshots) the memory as it ran out."""
        mine = isinstance(err, torch.cuda.OutOfMemoryError)
        if self._phase != _BACKWARD and (self.vote or self._phase == _STEP):
            if self.vote:  # the others' vote at the step's end: they end too
                group.any_rank(True)
            log.warning("out of memory at step %d %s: not retried (a step cannot be repeated, "
                        "and a smaller micro-batch does not shrink its memory)",
                        self.state.global_step + 1, "in the optimizer step"
                        if self._phase == _STEP else "after the last backward")
            raise err
        if self.vote and mine:  # the others wait in the vote after their backward
            group.any_rank(True)
        current = size or max(batch_size(b) for b in window)
        smaller = min(group.all_gather(current // 2))  # every rank moves to the same size
        if smaller < 1:
            if mine:
                raise err
            raise torch.cuda.OutOfMemoryError(
                "CUDA out of memory on another rank at a micro-batch of 1 sample")
        if mine and self.on_oom is not None:
            self.on_oom(err)  # the memory as it ran out
        oom.release(err, self.step.optimizer)
        self.step.precision.reset()  # a clipping's unscale_ went with the gradients
        self.state.micro_batch_size = smaller
        log.warning("out of memory at step %d with micro-batches of %d: the same step again with "
                    "micro-batches of %d (the global batch is unchanged)%s",
                    self.state.global_step + 1, current, smaller,
                    "; the compiled model recompiles for the new shape" if self.compiled else "")

    def _after_backward(self, last: bool) -> None:
        """After each micro-batch's backward: the DDP vote; after the last, the step is past
        what a retry can repeat on other ranks."""
        if self.vote:
            self._agree_and_reduce(last)
        if last:
            self._phase = _AFTER_BACKWARD

    def _agree_and_reduce(self, last: bool) -> None:
        """After each micro-batch's backward: did any rank run out? After the last, if none did,
        average the gradients (DDP's all-reduce was held back: a rank out of memory would never join
        it). A vote per micro-batch keeps the ranks' collectives (DDP's buffer broadcasts) in step;
        bucketing comes before the vote, so running out there is retried like a backward.
        """
        buckets = bucket_gradients(self.step.model.parameters()) if last else []
        if group.any_rank(False)[0]:
            raise _PeerOutOfMemory
        average_buckets(buckets)


# How far an attempt of a step got: its micro-batches' backward, past the last, optimizer.step.
_BACKWARD, _AFTER_BACKWARD, _STEP = "backward", "after backward", "step"
# gradients per all-reduce (DDP's default bucket_cap_mb)
BUCKET_BYTES = 25 * 2**20


class _Bucket(NamedTuple):
    flat: torch.Tensor  # the gradients, then one presence flag per parameter
    params: list[nn.Parameter]


def bucket_gradients(params: Iterable[nn.Parameter],
                     cap: int = BUCKET_BYTES) -> list[_Bucket]:
    """The gradients of ``params`` (those that require one) copied into flat buckets, by
    device and dtype, of about ``cap`` bytes each; each gradient is then a view of its bucket
    (its own memory freed at once: one bucket's worth of memory more at most). A parameter
    without a gradient (unused by this rank's forward) has zeros there and a presence flag of
    0, so every rank all-reduces the same buckets whichever parameters it used."""
    groups: dict[tuple[torch.device, torch.dtype], list[list[nn.Parameter]]] = {}
    filled: dict[tuple[torch.device, torch.dtype], int] = {}  # bytes in each kind's last
    for param in params:
        if not param.requires_grad:
            continue
        kind = (param.device, param.dtype)
        parts = groups.setdefault(kind, [[]])
        if filled.get(kind, 0) >= cap:
            parts.append([])
            filled[kind] = 0
        parts[-1].append(param)
        filled[kind] = filled.get(kind, 0) + param.numel() * param.element_size()
    return [_flatten(bucket) for parts in groups.values() for bucket in parts]


def _flatten(params: list[nn.Parameter]) -> _Bucket:
    total = sum(p.numel() for p in params)
    flat = torch.empty(total + len(params), dtype=params[0].dtype, device=params[0].device)
    flat[total:].zero_()
    offset = 0
    for i, param in enumerate(params):
        if param.grad is None:
            flat[offset:offset + param.numel()].zero_()
        else:
            grad = _grad_view(flat, offset, param)
            grad.copy_(param.grad)
            param.grad = grad
            flat[total + i].fill_(1)
        offset += param.numel()
    return _Bucket(flat, params)


def _grad_view(flat: torch.Tensor, offset: int, param: nn.Parameter) -> torch.Tensor:
    """``param``'s gradient as a view of ``flat`` from ``offset``, in ``param``'s memory layout
    (a channels_last weight gets a channels_last gradient, as autograd gives it): a fused
    optimizer reads a weight and its gradient element for element in memory order.
    ``empty_like`` on ``meta`` gives the strides a dense tensor of that layout has."""
    strides = torch.empty_like(param, device="meta").stride()
    return flat.as_strided(param.shape, strides, flat.storage_offset() + offset)


def average_buckets(buckets: Sequence[_Bucket]) -> None:
    """All-reduce the buckets (all in flight at once), divide by the world size, and give
    each parameter without a gradient here the average where another rank had one (a host
    read of the presence flags, only on a rank that lacks some gradient)."""
    works = [dist.all_reduce(bucket.flat, async_op=True) for bucket in buckets]
    world = dist.get_world_size()
    for work, (flat, params) in zip(works, buckets):
        work.wait()
        flat.div_(world)
        if all(p.grad is not None for p in params):
            continue
        total = flat.numel() - len(params)
        present = flat[total:].tolist()  # host sync: which the other ranks had
        offset = 0
        for param, seen in zip(params, present):
            if param.grad is None and seen > 0:
                param.grad = _grad_view(flat, offset, param)
            offset += param.numel()


def check_strategy(model: nn.Module, setting: int | str | None) -> None:
    """auto's retry averages gradients itself: with DDP or one process, not FSDP's shards."""
    from trainkit.distributed import fsdp

    if setting == "auto" and fsdp.is_sharded(model):
        raise TrainkitError("trainer.micro_batch_size=auto does not work with "
                            "trainer.strategy=fsdp: set a number of samples instead")
