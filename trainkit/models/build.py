"""The model a config node describes: its ``_target_`` built with its arguments, then the
fine-tuning keys trainkit reads itself (``lora``: adapters through PEFT).

The entry point builds a run's model with :func:`make_model`, and ``trainkit evaluate``,
``predict``, ``export`` and ``trainkit.load_model`` rebuild it with the same function from the
node a checkpoint stores, so a LoRA run's checkpoints load into the same wrapping.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from trainkit.models.lora import apply_lora


def make_model(node: Mapping[str, Any]) -> nn.Module:
    """``instantiate(node)`` less its ``lora`` key, with LoRA applied where that is set."""
    from hydra.utils import instantiate  # the config's own way to build it; only when called

    node = dict(node)
    lora = node.pop("lora", None)
    model = instantiate(node, _convert_="all")
    return apply_lora(model, lora) if lora else model
