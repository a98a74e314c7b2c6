"""Activation (gradient) checkpointing: recompute chosen blocks' activations in backward.

Trades compute for memory on large models, under one of two policies: ``full`` keeps only a
block's input and recomputes its whole forward in backward; ``selective`` also keeps the outputs
of its matmuls, attention and convolutions (the costly ops) and recomputes the cheap ones
(norms, activations, additions), with torch's selective checkpoint contexts. The blocks keep
their names and parameters (the forward is patched, not wrapped), so state_dict keys are
unchanged.
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
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from trainkit.config import CHECKPOINT_POLICIES
from trainkit.core.errors import ConfigError
from trainkit.core.submodules import match_modules, repeated_blocks
from trainkit.distributed.fsdp import is_sharded

log = logging.getLogger("trainkit")
KEY = "trainer.activation_checkpointing"
# What each policy keeps for backward, as the start line says it
_KEPT = {"full": "each block's input kept, the rest recomputed in backward",
         "selective": "matmul, attention and convolution outputs kept, the rest recomputed in "
                      "backward"}


def apply_activation_checkpointing(model: nn.Module, selectors: Sequence[str] | str) -> list[str]:
    """Checkpoint the submodules ``selectors`` names, under the policy it names (or ``full``).

    ``selectors`` is ``trainer.activation_checkpointing`` (empty: off, nothing wrapped):
    ``"full"`` or ``"selective"`` alone checkpoints the model's repeated blocks (a
    transformer's layers, a ResNet's stages: :func:`~trainkit.core.submodules.repeated_blocks`);
    otherwise class names (``"Block"``) or module paths from ``model.named_modules()``
    (``"layers.3"``), in full unless ``"selective"`` is among them. Uses non-reentrant
    checkpointing, which works with autocast, ``no_sync`` accumulation, DDP and
    ``torch.compile``. Logs one line saying what was wrapped under which
    policy; returns the wrapped modules' names.

    Raises:
        ConfigError: a selector matched nothing (a typo would otherwise silently save no memory;
            the message lists the model's module classes and top-level paths), two policies were
            named, or a policy alone found no repeated block.

    Example:
        >>> apply_activation_checkpointing(model, ["TransformerEncoderLayer"])  # doctest: +SKIP
        ['layers.0', 'layers.1']
        >>> apply_activation_checkpointing(gpt, "selective")  # doctest: +SKIP
        ['blocks.0', 'blocks.1', 'blocks.2', 'blocks.3']
    """
    if not selectors:  # trainer.activation_checkpointing=[]: off
        return []
    policy, chosen = split_policy(selectors)
    wrapped = match_modules(model, chosen, KEY) if chosen else repeated_blocks(model)
    if not wrapped:
        raise ConfigError(f"{KEY}={policy}: {type(model).__name__} has no repeated block to "
                          f"checkpoint; name the modules instead, e.g. [{policy}, <class or "
                          "path>]")
    modules = dict(model.named_modules())
    for name in wrapped:
        module = modules[name]
        if "forward" not in vars(module):  # not patched yet
            module.forward = functools.partial(_checkpointed, module, module.forward, policy)
    log.info("activation checkpointing (%s: %s): %s", policy, _KEPT[policy],
             _describe(model, wrapped))
    return wrapped


def check_sharded(model: nn.Module) -> nn.Module:
    """Refuse selective checkpointing of a module that holds FSDP units (after sharding).

    The selective contexts replay the forward's ops in order when backward recomputes it; an
    FSDP unit inside the checkpointed module gathers and frees its weights by hooks that run
    other ops in backward than in forward, so the replay fails in the first backward. Units
    that are the checkpointed modules themselves are fine (their hooks run outside).

    Returns:
        ``model``, as it was.

    Raises:
        ConfigError: one line naming the module, its units and what to set instead.
    """
    for name, module in model.named_modules():
        forward = vars(module).get("forward")
        if not (isinstance(forward, functools.partial) and forward.func is _checkpointed
                and forward.args[2] == "selective"):
            continue
        units = [sub for sub, inner in module.named_modules() if sub and is_sharded(inner)]
        if units:
            shown = units if len(units) <= 3 else [*units[:3], "..."]
            raise ConfigError(
                f"{KEY}: selective checkpointing of {name} is not possible under FSDP: it holds "
                f"FSDP units ({', '.join(shown)}), whose gathers differ in backward; checkpoint "
                "the units themselves (selective alone takes the repeated blocks) or use full")
    return model


def split_policy(selectors: Sequence[str] | str) -> tuple[str, list[str]]:
    """``(policy, the other selectors)``; at most one policy word, ``full`` when none."""
    selectors = [selectors] if isinstance(selectors, str) else list(selectors)
    policies = [s for s in selectors if s in CHECKPOINT_POLICIES]
    if len(policies) > 1:
        raise ConfigError(f"{KEY}: {policies} name two policies; keep one (full or selective)")
    others = [s for s in selectors if s not in CHECKPOINT_POLICIES]
    if not others and not policies:
        raise ConfigError(f"{KEY}: nothing to checkpoint; name full, selective or modules")
    return (policies[0] if policies else "full"), others


def _describe(model: nn.Module, wrapped: list[str]) -> str:
    """``"3 modules: Block x3 (layers.0, layers.1, layers.2)"``."""
    modules = dict(model.named_modules())
    counts = collections.Counter(type(modules[name]).__name__ for name in wrapped)
    classes = ", ".join(f"{cls} x{n}" for cls, n in counts.items())
    paths = wrapped if len(wrapped) <= 4 else [*wrapped[:2], "...", wrapped[-1]]
    plural = "" if len(wrapped) == 1 else "s"
    return f"{len(wrapped)} module{plural}: {classes} ({', '.join(paths)})"


def _checkpointed(module: nn.Module, forward: Any, policy: str, *args: Any, **kwargs: Any) -> Any:
    """``forward`` under non-reentrant checkpointing, batch-norm statistics updated once.

    Eager: the recomputation in backward runs the block's batch-norm layers again, so it runs
    under :func:`_norm_stats_frozen`. Under ``torch.compile`` a ``context_fn`` must be a pair of
    TorchDispatchModes (the selective ones are), and no freezing is needed: the compiled graph
    applies buffer mutations once, in the forward, and the backward recomputes only what the
    gradients need.
    """
    if torch.compiler.is_compiling():
        if policy == "full":
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=_selective, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False,
                      context_fn=functools.partial(_contexts, module, policy), **kwargs)


def _selective() -> tuple[Any, Any]:
    """torch's selective checkpoint contexts under :func:`_keep_costly_outputs`."""
    return create_selective_checkpoint_contexts(_keep_costly_outputs)


def _keep_costly_outputs(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save what is costly to recompute (matmuls, attention, convolutions); recompute the rest
    (``PREFER``: under ``torch.compile`` the partitioner may still keep a cheap output)."""
    return (CheckpointPolicy.MUST_SAVE if op in _costly_ops()
            else CheckpointPolicy.PREFER_RECOMPUTE)


@functools.cache
def _costly_ops() -> frozenset[Any]:
    """The aten ops whose outputs ``selective`` keeps (those this torch build has)."""
    names = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_mm",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    packets = (getattr(torch.ops.aten, name, None) for name in names)
    return frozenset(packet.default for packet in packets if packet is not None)


def _contexts(module: nn.Module, policy: str) -> tuple[Any, Any]:
    """Contexts for the first forward and for the recomputation in backward (eager)."""
    if policy == "full":
        return contextlib.nullcontext(), _norm_stats_frozen(module)
    first, again = _selective()
    return first, _both(_norm_stats_frozen(module), again)


@contextlib.contextmanager
def _both(outer: contextlib.AbstractContextManager[None], inner: Any) -> Iterator[None]:
    """``outer`` around ``inner``: the statistics are saved and restored outside the selective
    recomputation mode, whose ops must be the forward's, in order."""
    with outer, inner:
        yield


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
