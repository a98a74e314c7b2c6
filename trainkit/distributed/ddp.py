"""Data parallelism: DDP wrapping, unwrapping, and when gradients are averaged across ranks.

Each is a no-op in a single process (no process group, or one rank).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from trainkit.distributed import fsdp
from trainkit.distributed.group import is_distributed

if TYPE_CHECKING:
    from trainkit.core.runtime import Runtime


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside DDP and ``torch.compile`` wrappers (for clean state_dict keys)."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


def sync_gradients(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
    """Context for one micro-step's backward: skip DDP's all-reduce (FSDP's reduce-scatter and
    resharding) unless ``sync``.

    Accumulating k micro-batches only needs gradients averaged across ranks once, on the last one.
    Without DDP or FSDP this is a no-op.
    """
    if sync:  # checked first: this runs every step, and Module attribute misses are slow
        return contextlib.nullcontext()
    inner = model._modules.get("_orig_mod", model)  # through torch.compile's wrapper
    if isinstance(inner, nn.parallel.DistributedDataParallel):
        return inner.no_sync()
    if fsdp.is_sharded(inner):
        return fsdp.no_sync(inner)
    return contextlib.nullcontext()


def wrap_ddp(model: nn.Module, runtime: Runtime) -> nn.Module:
    """``model`` in ``DistributedDataParallel`` when a multi-rank group is up, else unchanged.

    DDP broadcasts rank 0's parameters and buffers at construction, so every replica starts equal.
    """
    if not is_distributed():
        return model
    device_ids = [runtime.device] if runtime.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


def broadcast_buffers(model: nn.Module, *more: torch.Tensor) -> None:
    """Give every rank rank 0's buffers (and ``more`` tensors), in place.

    Buffers are never sharded nor averaged: each rank folds its own batches into its batch-norm
    statistics (DDP broadcasts rank 0's at each forward, FSDP not at all), so ranks drift apart.
    Called before every evaluation and save, so what is reported and saved is rank 0's.
    Rank 0's own are left as they are: a save in between (a preemption) changes nothing there.
    """
    if not is_distributed():
        return
    for buffer in (*unwrap(model).buffers(), *more):
        dist.broadcast(buffer, src=0)
