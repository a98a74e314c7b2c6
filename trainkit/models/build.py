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
import inspect
from collections.abc import Mapping
from typing import Any

from torch import nn

from trainkit.core.errors import ConfigError
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
        drop_path = node.pop("drop_path", None)
        if drop_path:  # model.drop_path: the model's own stochastic-depth argument
            node[drop_path_argument(node)] = drop_path
    if isinstance(lora, DictConfig):
        lora = OmegaConf.to_container(lora, resolve=True)
    model = instantiate(node, _convert_="all")
    if pretrained and weights:
        load_pretrained(model, weights)
    return apply_lora(model, lora) if lora else model


# stochastic depth's argument: timm's, torchvision's
DROP_PATH_ARGUMENTS = ("drop_path_rate", "stochastic_depth_prob")


def drop_path_argument(node: Mapping[str, Any]) -> str:
    """The argument of ``node``'s model that takes ``model.drop_path``: ``drop_path_rate``
    (timm's models) or ``stochastic_depth_prob`` (torchvision's convnext, efficientnet, swin,
    ...), read from the signature of the class the target builds.

    Raises:
        ConfigError: the model has neither (resnet, vit_b_16, your own without one).
    """
    from hydra.utils import get_object

    target = str(node.get("_target_", ""))
    built: Any = get_object(target) if target else None
    if target == "trainkit.models.vision.torchvision_classifier":
        import torchvision

        built = torchvision.models.get_model_builder(str(node.get("name")))
    if target.startswith("timm."):
        return "drop_path_rate"  # timm.create_model passes it to every model of timm's
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
