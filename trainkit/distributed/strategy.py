"""How a model is placed for training: device, memory layout, then DDP or FSDP2, and
``torch.compile`` last. ``Trainer.fit`` and ``trainkit probe`` both use it, so the probe measures
the model fit trains. (Activation checkpointing, a change of the model's own forward, comes
before: :func:`trainkit.loop.activations.apply_activation_checkpointing`.)"""

from __future__ import annotations

import collections
import logging
from typing import Any

import torch
from torch import nn

from trainkit.core.runtime import Runtime
from trainkit.core.submodules import repeated_blocks
from trainkit.distributed import ddp, fsdp, group

log = logging.getLogger("trainkit")


def prepare_model(model: nn.Module, optimizer: torch.optim.Optimizer, config: Any,
                  runtime: Runtime, precision: str) -> nn.Module:
    """``model`` as fit trains it, before compiling: on the device, in its memory layout, then
    in DDP or FSDP (rank 0's weights on every rank).

    Args:
        model: the user's module.
        optimizer: its optimizer (FSDP moves its state onto the shards).
        config: a :class:`~trainkit.config.TrainerConfig` (strategy, channels_last, fsdp_*).
        runtime: device and ranks; the process group is joined here when there are several.
        precision: the resolved precision mode (FSDP's mixed-precision policy follows it).
    """
    model = model.to(runtime.device)
    sharded = fsdp.resolve_strategy(config.strategy, runtime.world_size) == "fsdp"
    if config.channels_last and sharded:
        # fully_shard takes contiguous parameters only; a convolution given NHWC inputs
        # (the loaders make them) computes in NHWC whatever its weights' layout
        log.info("channels_last: the inputs only (fully_shard takes contiguous weights; "
                 "convolutions follow their inputs' layout)")
    elif config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    group.init_process_group(runtime)  # no-op in one process or when already up
    if sharded:
        return fsdp.shard_model(model, optimizer, runtime, blocks=config.fsdp_blocks,
                                reshard_after_forward=config.fsdp_reshard_after_forward,
                                precision=precision)
    if config.fsdp_blocks:
        log.warning("trainer.fsdp_blocks is ignored: trainer.strategy=%s does not shard "
                    "(set trainer.strategy=fsdp)", config.strategy)
    return ddp.wrap_ddp(model, runtime)  # auto or ddp; one process: as it is


def compiled(model: nn.Module, mode: bool | str = True) -> nn.Module:
    """``torch.compile`` as ``trainer.compile`` says: ``True`` the whole model, ``"regional"``
    each repeated block (:func:`compile_blocks`); under FSDP either way each unit's forward in
    place (compiling the sharded whole would compile nothing: :func:`fsdp.compile_units`; the
    units are the repeated blocks unless ``trainer.fsdp_blocks`` names others)."""
    if fsdp.is_sharded(model):
        units, eager = fsdp.compile_units(model)
        shown = units if len(units) <= 4 else [*units[:2], "...", units[-1]]
        log.info("compile: the forward of %d FSDP unit%s (%s), FSDP's gathers eager between "
                 "them%s", len(units), "" if len(units) == 1 else "s", ", ".join(shown),
                 f"; {len(eager)} one-layer units eager" if eager else "")
        return model
    if mode == "regional":
        blocks = compile_blocks(ddp.unwrap(model))
        if blocks:
            return model
    log.info("compile: the whole model (torch.compile)")
    return torch.compile(model)


def compile_blocks(model: nn.Module) -> list[str]:
    """``module.compile()`` on each of the model's repeated blocks, in place; their paths.

    Regional compilation (torch's recipe for cold start): the blocks are instances of one class
    (:func:`~trainkit.core.submodules.repeated_blocks`: a transformer's layers, a ResNet's
    stages), so dynamo traces and compiles the class's forward once and the other instances
    reuse the code (their parameters are the graph's inputs, not constants); the rest of the
    model runs eagerly. Parameter names do not change (``Module.compile`` keeps the module).
    Blocks that differ (a ResNet's stages: other widths, a downsampling layer) each compile
    their own graph, and all compiled blocks share dynamo's limit of graphs per code object
    (``recompile_limit``, 8): past it, further variants (evaluation mode, a new batch size)
    run eagerly, with dynamo's warning.
    Blocks that are single layers (no submodules: nothing to fuse) are not compiled: ``[]``,
    and the caller compiles the whole model instead, as it does for a model with no repeated
    block; the log line says which it was.
    """
    blocks = repeated_blocks(model)
    modules = dict(model.named_modules())
    if not blocks or not any(True for _ in modules[blocks[0]].children()):
        log.info("compile=regional: %s has no repeated block of several layers",
                 type(model).__name__)
        return []
    for name in blocks:
        modules[name].compile()
    counts = collections.Counter(type(modules[name]).__name__ for name in blocks)
    shown = blocks if len(blocks) <= 4 else [*blocks[:2], "...", blocks[-1]]
    log.info("compile: regional, %d blocks (%s: %s), blocks alike share one compiled graph; "
             "the rest eager",
             len(blocks), ", ".join(f"{cls} x{n}" for cls, n in counts.items()),
             ", ".join(shown))
    return blocks
