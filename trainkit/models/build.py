"""The model a config node describes: its ``_target_`` built with its arguments, then the
fine-tuning keys trainkit reads itself (``pretrained``: weights from a file; ``lora``: adapters
through PEFT).

The entry point builds a run's model with :func:`make_model`, and ``trainkit evaluate``,
``predict``, ``export`` and ``trainkit.load_model`` rebuild it with the same function from the
node a checkpoint stores, so a LoRA run's checkpoints load into the same wrapping.
"""

from __future__ import annotations

import copy
import inspect
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
        (ModelKeys(pretrained='w.pt', lora=None, drop_path=0.0), {'_target_': 'm.Net', 'width': 3})
    """

    # weights to start a new run from: a file or a Hugging Face folder (models/pretrained.py)
    pretrained: str | None = None
    # PEFT's LoraConfig arguments ({r, alpha, dropout, target_modules}: models/lora.py)
    lora: dict[str, Any] | None = None
    # stochastic depth, given to the model's own argument (:func:`drop_path_argument`); 0: off
    drop_path: float = 0.0

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
        drop_path = node.get("drop_path") or 0.0
        if isinstance(drop_path, bool) or not isinstance(drop_path, (int, float)) or not (
                0 <= drop_path < 1):
            raise ConfigError(f"model.drop_path must be in [0, 1), got {drop_path!r}")
        if drop_path:  # the model's own stochastic-depth argument, or one line
            rest[drop_path_argument(rest)] = float(drop_path)
        return cls(None if pretrained is None else str(pretrained),
                   None if lora is None else dict(lora), float(drop_path)), rest


MODEL_KEYS = tuple(f.name for f in fields(ModelKeys))
# stochastic depth's argument: timm's, torchvision's
DROP_PATH_ARGUMENTS = ("drop_path_rate", "stochastic_depth_prob")


def with_drop_path_argument(node: Mapping[str, Any]) -> dict[str, Any]:
    """``node`` with ``drop_path`` given as the model's own argument (:func:`drop_path_argument`),
    or left out when 0: a node ``hydra.utils.instantiate`` builds (an export's model.json)."""
    rest = {key: value for key, value in node.items() if key != "drop_path"}
    if node.get("drop_path"):
        rest[drop_path_argument(rest)] = node["drop_path"]
    return rest


def drop_path_argument(node: Mapping[str, Any]) -> str:
    """The argument of ``node``'s model that takes ``model.drop_path``: ``drop_path_rate``
    (timm's models) or ``stochastic_depth_prob`` (torchvision's convnext, efficientnet, swin,
    ...), read from the signature of the class the target builds.

    Raises:
        ConfigError: the model has neither (resnet, vit_b_16, your own without one).
    """
    from hydra.utils import get_object

    target = str(node.get("_target_", ""))
    if target.startswith("timm."):
        return "drop_path_rate"  # timm.create_model passes it to every model of timm's
    built: Any = get_object(target) if target else None
    if target == "trainkit.models.vision.torchvision_classifier":
        import torchvision

        built = torchvision.models.get_model_builder(str(node.get("name")))
    returns = inspect.signature(built).return_annotation if callable(built) else None
    cls = returns if isinstance(returns, type) else built
    try:
        params = inspect.signature(cls).parameters if cls is not None else {}
    except (TypeError, ValueError):
        params = {}
    for name in DROP_PATH_ARGUMENTS:
        if name in params:
            return name
    raise ConfigError(f"model.drop_path: {target or 'this model'} takes no drop_path_rate or "
                      "stochastic_depth_prob (stochastic depth); remove model.drop_path")


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
    model = instantiate(_in_place(node, arguments), _convert_="all")
    if pretrained and keys.pretrained:
        load_pretrained(model, keys.pretrained)
    return apply_lora(model, keys.lora) if keys.lora else model


def _in_place(node: Mapping[str, Any], arguments: dict[str, Any]) -> Any:
    """``arguments`` as a copy of the config ``node`` where it is one, so that it keeps its
    place and Hydra's errors name ``model.<key>``; as they are otherwise."""
    from omegaconf import DictConfig, open_dict

    if not isinstance(node, DictConfig):
        return arguments
    placed = copy.deepcopy(node)
    with open_dict(placed):
        for key in MODEL_KEYS:
            placed.pop(key, None)
        for key in arguments.keys() - placed.keys():  # the model's own drop-path argument
            placed[key] = arguments[key]
    return placed
