"""Activation (gradient) checkpointing: recompute chosen blocks' activations in backward.

Trades compute for memory on large models. The blocks keep their names and parameters (the
forward is patched, not wrapped), so state_dict keys are unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

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
            module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)
        matched |= keys
        wrapped.append(name)
    unknown = wanted - matched
    if unknown:
        raise ConfigError(
            f"trainer.activation_checkpointing: {sorted(unknown)} match no module class or name "
            "in the model; use class names (e.g. 'Block') or paths from model.named_modules()"
        )
    return wrapped
