"""Activation (gradient) checkpointing: recompute chosen blocks' activations in backward.

Trades compute for memory on large models. The blocks keep their names and parameters (the
forward is patched, not wrapped), so state_dict keys are unchanged.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainkit.errors import ConfigError


def apply_activation_checkpointing(model: nn.Module, selectors: Sequence[str]) -> list[str]:
    """Checkpoint every submodule whose class name or qualified name is in ``selectors``.

    A selector matches a class name (``"Block"``, ``"TransformerEncoderLayer"``) or a module
    path from ``model.named_modules()`` (``"layers.3"``). Uses non-reentrant checkpointing, which
    works with autocast, ``no_sync`` accumulation and DDP. Returns the names of the wrapped modules.

    Raises:
        ConfigError: a selector matched nothing (a typo would otherwise silently save no memory).

    Example:
        >>> apply_activation_checkpointing(model, ["TransformerEncoderLayer"])  # doctest: +SKIP
        ['layers.0', 'layers.1']
    """
    wanted = set(selectors)
    matched: set[str] = set()
    wrapped: list[str] = []
    for name, module in model.named_modules():
        if not name:
            continue
        keys = {type(module).__name__, name} & wanted
        if not keys:
            continue
        # Skip modules inside one already wrapped: recomputing twice buys nothing.
        if any(name.startswith(done + ".") for done in wrapped):
            matched |= keys
            continue
        if "forward" not in vars(module):  # not patched yet
            module.forward = functools.partial(
                checkpoint, module.forward, use_reentrant=False,
                context_fn=functools.partial(_contexts, module))
        matched |= keys
        wrapped.append(name)
    unknown = wanted - matched
    if unknown:
        raise ConfigError(
            f"trainer.activation_checkpointing: {sorted(unknown)} match no module class or name "
            "in the model; use class names (e.g. 'Block') or paths from model.named_modules()"
        )
    return wrapped


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
