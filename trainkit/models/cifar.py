"""A fast CIFAR-10 convnet in the style of the speed records (airbench): no residual connections.

Three conv groups (conv, max-pool, batch-norm, GELU, conv, batch-norm, GELU) after a small stem,
widths 64/256/256, global max-pool, linear head. In eval mode it averages the logits of each
image and its mirror image (test-time flip), so the trainer needs nothing special for it.
"""

from __future__ import annotations

import torch
from torch import nn


def _conv_bn(c_in: int, c_out: int, *, pool: bool = False) -> list[nn.Module]:
    layers: list[nn.Module] = [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)]
    if pool:  # pool before batch-norm: it then runs on a quarter of the activations
        layers.append(nn.MaxPool2d(2))
    return [*layers, nn.BatchNorm2d(c_out), nn.GELU()]


class CifarNet(nn.Module):
    """Stem, three conv groups that halve the resolution, global max-pool, linear head.

    Args:
        widths: channels of the stem and the three groups.
        num_classes: outputs of the head.
        logit_scale: multiplies the logits; a scale below 1 (airbench uses 1/9) keeps early
            predictions soft, which suits the high learning rates of short schedules.
        tta_flip: in eval mode, average the logits of the image and its horizontal mirror.

    Example:
        >>> net = CifarNet(widths=(8, 16, 32, 32)).eval()
        >>> net(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(self, widths: tuple[int, int, int, int] = (32, 64, 256, 256),
                 num_classes: int = 10, logit_scale: float = 1.0, tta_flip: bool = True) -> None:
        super().__init__()
        stem, w1, w2, w3 = widths
        self.features = nn.Sequential(
            *_conv_bn(3, stem),
            *_conv_bn(stem, w1, pool=True), *_conv_bn(w1, w1),  # 16x16
            *_conv_bn(w1, w2, pool=True), *_conv_bn(w2, w2),  # 8x8
            *_conv_bn(w2, w3, pool=True), *_conv_bn(w3, w3),  # 4x4
            nn.AdaptiveMaxPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(w3, num_classes, bias=False)
        self.logit_scale = logit_scale
        self.tta_flip = tta_flip

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x)) * self.logit_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training or not self.tta_flip:
            return self._logits(x)
        # One forward over both views: a batch twice the size keeps the device busier.
        both = self._logits(torch.cat([x, x.flip(-1)]))
        return (both[: len(x)] + both[len(x) :]) / 2
