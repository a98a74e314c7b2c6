"""The model a config node describes: its ``_target_`` built with its arguments, then the
fine-tuning keys trainkit reads itself (``pretrained``: weights from a file; ``lora``: adapters
through PEFT).

The entry point builds a run's model with :func:`make_model`, and ``trainkit evaluate``,
``predict``, ``export`` and ``trainkit.load_model`` rebuild it with the same function from the
node a checkpoint stores, so a LoRA run's checkpoints load into the same wrapping.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from torch import nn

from trainkit.core.errors import ConfigError
from trainkit.models.lora import apply_lora
from trainkit.models.pretrained import load_pretrained


@dataclass(frozen=True)
class ModelKeys:
    """The keys of a ``model`` config node that trainkit reads itself, not the model's class
    (the only list of them: :data:`MODEL_KEYS`). Every other key is an argument of its
    ``_target_``.

    Example:
        >>> ModelKeys.split({"_target_": "m.Net", "width": 3, "pretrained": "w.pt"})
        (ModelKeys(pretrained='w.pt', lora=None), {'_target_': 'm.Net', 'width': 3})
    """

    # weights to start a new run from: a file or a Hugging Face folder (models/pretrained.py)
    pretrained: str | None = None
    # PEFT's LoraConfig arguments ({r, alpha, dropout, target_modules}: models/lora.py)
    lora: dict[str, Any] | None = None

    @classmethod
    def split(cls, node: Mapping[str, Any]) -> tuple[ModelKeys, dict[str, Any]]:
        """``node``'s own keys, type-checked, and the rest: what its ``_target_`` takes.

        Raises:
            ConfigError: ``model.pretrained`` is not a path, or ``model.lora`` not a mapping.
        """
        from omegaconf import DictConfig, OmegaConf

        if isinstance(node, DictConfig):
            node = OmegaConf.to_container(node, resolve=True)
        rest = {key: value for key, value in node.items() if key not in MODEL_KEYS}
        pretrained, lora = node.get("pretrained"), node.get("lora")
        if pretrained is not None and not isinstance(pretrained, (str, os.PathLike)):
            raise ConfigError(f"model.pretrained must be a weights file or folder (or null), "
                              f"got {pretrained!r}")
        if lora is not None and not isinstance(lora, Mapping):
            raise ConfigError(f"model.lora must be a mapping of PEFT's LoraConfig arguments, "
                              f"e.g. '{{r: 8, alpha: 16}}' (or null), got {lora!r}")
        return cls(None if pretrained is None else str(pretrained),
                   None if lora is None else dict(lora)), rest


MODEL_KEYS = tuple(f.name for f in fields(ModelKeys))


def class_arguments(node: Mapping[str, Any]) -> dict[str, Any]:
    """The model config ``node`` without :data:`MODEL_KEYS`: what its ``_target_`` takes."""
    return ModelKeys.split(node)[1]


def make_model(node: Mapping[str, Any], *, pretrained: bool = False) -> nn.Module:
    """``instantiate(node)`` less the keys trainkit reads (:class:`ModelKeys`): with
    ``pretrained`` (a new run's model; a rebuilt one takes its checkpoint's weights)
    ``model.pretrained``'s weights loaded, then LoRA applied where ``model.lora`` is set (the
    adapters wrap the loaded weights)."""
    from hydra.utils import instantiate  # the config's own way to build it; only when called

    keys, arguments = ModelKeys.split(node)
    model = instantiate(arguments, _convert_="all")
    if pretrained and keys.pretrained:
        load_pretrained(model, keys.pretrained)
    return apply_lora(model, keys.lora) if keys.lora else model
