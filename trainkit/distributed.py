"""torch.distributed helpers that degrade to no-ops in a single process."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn


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
    """Context for one micro-step's backward: skip DDP's all-reduce unless ``sync``.

    Accumulating k micro-batches only needs gradients averaged across ranks once, on the last one.
    Without DDP this is a no-op.
    """
    if sync:  # checked first: this runs every step, and Module attribute misses are slow
        return contextlib.nullcontext()
    inner = model._modules.get("_orig_mod", model)  # through torch.compile's wrapper
    if isinstance(inner, nn.parallel.DistributedDataParallel):
        return inner.no_sync()
    return contextlib.nullcontext()


def barrier() -> None:
    """Wait for every rank; nothing to wait for in a single process."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
