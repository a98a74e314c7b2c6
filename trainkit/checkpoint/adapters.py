"""``checkpoint.adapters_only=true``: a LoRA run's checkpoints keep only what trains.

:class:`AdaptersOnly` stands for the model in the Checkpointer: its ``state_dict`` is the
model's trainable tensors alone (the LoRA adapters, and PEFT's ``modules_to_save`` such as a
classifier's new head), under the model's own key names; loading one sets those and leaves the
frozen base as built (from ``model.path``, or the run's seeded initialisation). A checkpoint is
then megabytes instead of the whole model, and still resumes exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from trainkit.core.errors import ConfigError
from trainkit.distributed import fsdp
from trainkit.models.lora import is_lora


class AdaptersOnly(nn.Module):
    """The trainable part of ``model`` for checkpoints (``state_dict``/``load_state_dict``): a
    module only so that the storages, which ask what a model is (sharded or not), can hold it.

    Raises:
        ConfigError: ``model`` has no LoRA adapters, or is sharded by FSDP (whose checkpoints
            are directories of the whole model).
    """

    def __init__(self, model: nn.Module) -> None:
        check_adapters_only(model, sharded=fsdp.is_sharded(model))
        super().__init__()
        self.model = model
        self.keys = {name for name, p in model.named_parameters() if p.requires_grad}

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.model.state_dict().items() if k in self.keys}

    def load_state_dict(self, state: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        """Set the trainable tensors (all of them: a missing or extra one is an error)."""
        if set(state) != self.keys:
            missing, extra = sorted(self.keys - set(state)), sorted(set(state) - self.keys)
            raise ConfigError(f"the checkpoint's adapters do not fit this model (missing: "
                              f"{missing[:3]}, unexpected: {extra[:3]}): resume with the "
                              "run's own model.lora")
        return self.model.load_state_dict(dict(state), strict=False)


def check_adapters_only(model: nn.Module, *, sharded: bool) -> None:
    """``checkpoint.adapters_only=true`` fits ``model`` (a LoRA model, not ``sharded`` by FSDP);
    the entry point asks before the run starts, so that a refusal leaves nothing behind.

    Raises:
        ConfigError: one line saying why, and what to set instead.
    """
    if not is_lora(model):
        raise ConfigError("checkpoint.adapters_only=true keeps a LoRA run's adapters: set "
                          "model.lora, or checkpoint.adapters_only=false")
    if sharded:
        raise ConfigError("checkpoint.adapters_only=true: an FSDP run's checkpoints are "
                          "sharded directories of the whole model; use trainer.strategy=ddp, "
                          "or checkpoint.adapters_only=false")
