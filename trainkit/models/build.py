"""The model a config node describes: its ``_target_`` built with its arguments, then the
fine-tuning keys trainkit reads itself (``pretrained``: weights from a file; ``lora``: adapters
through PEFT).

The entry point builds a run's model with :func:`make_model`, and ``trainkit evaluate``,
``predict``, ``export`` and ``trainkit.load_model`` rebuild it with the same function from the
node a checkpoint stores, so a LoRA run's checkpoints load into the same wrapping.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping
from typing import Any

from torch import nn

from trainkit.models.lora import apply_lora
from trainkit.models.pretrained import load_pretrained


def make_model(node: Mapping[str, Any], *, pretrained: bool = False) -> nn.Module:
    """``instantiate(node)`` less the keys trainkit reads: with ``pretrained`` (a new run's
    model; a rebuilt one takes its checkpoint's weights) ``model.pretrained``'s weights loaded,
    then LoRA applied where ``model.lora`` is set (the adapters wrap the loaded weights)."""
    from hydra.utils import instantiate  # the config's own way to build it; only when called
    from omegaconf import DictConfig, OmegaConf, open_dict

    node = copy.deepcopy(node)  # a config's node keeps its place: errors name model.<key>
    with open_dict(node) if isinstance(node, DictConfig) else contextlib.nullcontext():
        lora, weights = node.pop("lora", None), node.pop("pretrained", None)
    if isinstance(lora, DictConfig):
        lora = OmegaConf.to_container(lora, resolve=True)
    model = instantiate(node, _convert_="all")
    if pretrained and weights:
        load_pretrained(model, weights)
    return apply_lora(model, lora) if lora else model
