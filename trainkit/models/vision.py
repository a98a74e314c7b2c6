"""torchvision's classifiers for any number of image channels (``model=resnet18`` and the others).

``configs/model/*.yaml`` name them as torchvision does (``torchvision.models.resnet18``), so a
run's export loads with torchvision alone. For data of other than 3 channels (a grayscale
folder, ``data.channels=1``) the entry point passes the node through :func:`for_channels`: the
same model from :func:`torchvision_classifier`, whose stem takes the data's channels, instead of
a size-mismatch error at the first step. A pretrained stem's weights are summed over colour,
timm's ``in_chans`` way, so the network answers a gray image as it answered its RGB version.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

_TORCHVISION = re.compile(r"torchvision\.models\.(\w+)")  # a classifier's builder


def for_channels(node: Mapping[str, Any], channels: int) -> Mapping[str, Any]:
    """A model config node for data of ``channels`` channels: ``node`` itself, unless it names
    a torchvision classifier (``torchvision.models.<name>``) and the data is not RGB; then the
    same model built by :func:`torchvision_classifier` with ``in_chans=channels``."""
    found = _TORCHVISION.fullmatch(str(node.get("_target_", "")))
    if channels == 3 or found is None:
        return node
    rest = {k: v for k, v in node.items() if k != "_target_"}
    return {"_target_": f"{__name__}.torchvision_classifier", "name": found.group(1),
            "in_chans": channels, **rest}


def torchvision_classifier(name: str, num_classes: int, in_chans: int = 3,
                           weights: str | None = None, **kwargs: Any) -> nn.Module:
    """``torchvision.models.get_model(name, weights=..., num_classes=..., **kwargs)`` whose
    first convolution takes ``in_chans`` channels.

    Example:
        >>> model = torchvision_classifier("resnet18", num_classes=10, in_chans=1)
        >>> model(torch.zeros(2, 1, 64, 64)).shape
        torch.Size([2, 10])
    """
    import torchvision  # heavy import: only when a torchvision model is built

    model = torchvision.models.get_model(name, weights=weights, num_classes=num_classes,
                                         **kwargs)
    if in_chans != 3:
        adapt_stem(model, in_chans)
    return model


def adapt_stem(model: nn.Module, in_chans: int) -> None:
    """Replace ``model``'s first ``Conv2d`` (its stem) by one taking ``in_chans`` channels, its
    weights the old ones summed over colour (1 channel), or tiled and rescaled (others)."""
    path, stem = next((p, m) for p, m in model.named_modules() if isinstance(m, nn.Conv2d))
    new = nn.Conv2d(in_chans, stem.out_channels, stem.kernel_size, stride=stem.stride,
                    padding=stem.padding, dilation=stem.dilation, groups=stem.groups,
                    bias=stem.bias is not None, padding_mode=stem.padding_mode)
    with torch.no_grad():
        new.weight.copy_(adapt_input_conv(in_chans, stem.weight))
        if stem.bias is not None:
            new.bias.copy_(stem.bias)
    parent, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent), attr, new)


def adapt_input_conv(in_chans: int, weight: torch.Tensor) -> torch.Tensor:
    """An RGB convolution's weights ``[out, 3, kh, kw]`` for ``in_chans`` input channels (timm's
    ``adapt_input_conv``): summed over colour for one; tiled and scaled by ``3 / in_chans``
    for more, so the response to a gray image keeps its size."""
    if in_chans == 1:
        return weight.sum(dim=1, keepdim=True)
    repeat = -(-in_chans // weight.shape[1])
    return weight.repeat(1, repeat, 1, 1)[:, :in_chans] * (weight.shape[1] / in_chans)
