"""Activation (gradient) checkpointing: recompute chosen blocks' activations in backward.

Trades compute for memory on large models. The blocks keep their names and parameters (the
forward is patched, not wrapped), so state_dict keys are unchanged.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainkit.core.submodules import match_modules

log = logging.getLogger("trainkit")


def apply_activation_checkpointing(model: nn.Module, selectors: Sequence[str]) -> list[str]:
    """Checkpoint every submodule whose class name or qualified name is in ``selectors``.

    A selector matches a class name (``"Block"``, ``"TransformerEncoderLayer"``) or a module
    path from ``model.named_modules()`` (``"layers.3"``, ``"features"``). Uses non-reentrant
    checkpointing, which works with autocast, ``no_sync`` accumulation, DDP and
    ``torch.compile``. Logs one line saying what was wrapped; returns the wrapped modules' names.

    Raises:
        ConfigError: a selector matched nothing (a typo would otherwise silently save no memory);
            the message lists the model's module classes and top-level paths.

    Example:
        >>> apply_activation_checkpointing(model, ["TransformerEncoderLayer"])  # doctest: +SKIP
        ['layers.0', 'layers.1']
    """
    wrapped = match_modules(model, selectors, "trainer.activation_checkpointing")
    modules = dict(model.named_modules())
    for name in wrapped:
        module = modules[name]
        if "forward" not in vars(module):  # not patched yet
            module.forward = functools.partial(_checkpointed, module, module.forward)
    if wrapped:
        log.info("activation checkpointing: %s", _describe(model, wrapped))
    return wrapped


def _describe(model: nn.Module, wrapped: list[str]) -> str:
    """``"3 modules recomputed in backward: Block x3 (layers.0, layers.1, layers.2)"``."""
    modules = dict(model.named_modules())
    counts = collections.Counter(type(modules[name]).__name__ for name in wrapped)
    classes = ", ".join(f"{cls} x{n}" for cls, n in counts.items())
    paths = wrapped if len(wrapped) <= 4 else [*wrapped[:2], "...", wrapped[-1]]
    plural = "" if len(wrapped) == 1 else "s"
    return f"{len(wrapped)} module{plural} recomputed in backward: {classes} ({', '.join(paths)})"


def _checkpointed(module: nn.Module, forward: Any, *args: Any, **kwargs: Any) -> Any:
    """``forward`` under non-reentrant checkpointing, batch-norm statistics updated once.

    Eager: the recomputation in backward runs the block's batch-norm layers again, so it runs
    under :func:`_norm_stats_frozen`. Under ``torch.compile`` a ``context_fn`` must be a pair of
    TorchDispatchModes, and none is needed: the compiled graph applies buffer mutations once, in
    the forward, and the backward recomputes only what the gradients need.
    """
    if torch.compiler.is_compiling():
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False,
                      context_fn=functools.partial(_contexts, module), **kwargs)


def _contexts(module: nn.Module) -> tuple[contextlib.AbstractContextManager[None], ...]:
    """Contexts for the first forward and for the recomputation in backward."""
    return contextlib.nullcontext(), _norm_stats_frozen(module)


@contextlib.contextmanager
def _norm_stats_frozen(module: nn.Module) -> Iterator[None]:
    """Undo what the recomputed forward does to batch-norm running statistics.

    Recomputing a block in training mode runs its batch-norm layers a second time, which would
    fold each batch into the running mean and variance twice.
    """
    buffers = [b for m in module.modules() if isinstance(m, nn.modules.batchnorm._NormBase)
               for b in m.buffers()]
    saved = [b.clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(buffers, saved):
                buffer.copy_(value)
