"""How a model is placed for training: device, memory layout, then DDP or FSDP2, and
``torch.compile`` last. ``Trainer.fit`` and ``trainkit probe`` both use it, so the probe measures
the model fit trains. (Activation checkpointing, a change of the model's own forward, comes
before: :func:`trainkit.loop.activations.apply_activation_checkpointing`.)"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from trainkit.core.runtime import Runtime
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


def compiled(model: nn.Module) -> nn.Module:
    """``torch.compile``: the whole model, or under FSDP each unit's forward in place
    (compiling the sharded whole would compile nothing: :func:`fsdp.compile_units`)."""
    if fsdp.is_sharded(model):
        units, eager = fsdp.compile_units(model)
        shown = units if len(units) <= 4 else [*units[:2], "...", units[-1]]
        log.info("compile: the forward of %d FSDP unit%s (%s), FSDP's gathers eager between "
                 "them%s", len(units), "" if len(units) == 1 else "s", ", ".join(shown),
                 f"; {len(eager)} one-layer units eager" if eager else "")
        return model
    log.info("compile: the whole model (torch.compile)")
    return torch.compile(model)
