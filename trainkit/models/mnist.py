"""A small, fast MNIST convnet: ~99% test accuracy in one epoch on a laptop CPU."""

from __future__ import annotations

import torch
from torch import nn


def _block(c_in: int, c_out: int, pool: bool) -> list[nn.Module]:
    # Pool before batch-norm and ReLU: they then run on a quarter of the activations, and
    # max-pooling commutes with ReLU, so the network computes nearly the same function.
    layers: list[nn.Module] = [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return [*layers, nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]


class MnistNet(nn.Module):
    """Space-to-depth stem, three conv blocks, global max-pool, linear head.

    The stem folds each 2x2 patch into 4 channels (28x28x1 -> 14x14x4), so no convolution runs at
    full resolution: one-channel convolutions are the slowest kind on CPUs.

    Args:
        widths: channels of the three conv blocks.
        num_classes: outputs of the head.
    """

    def __init__(self, widths: tuple[int, int, int] = (32, 64, 128), num_classes: int = 10) -> None:
        super().__init__()
        w1, w2, w3 = widths
        self.features = nn.Sequential(
            nn.PixelUnshuffle(2),
            *_block(4, w1, pool=True),  # 7x7
            *_block(w1, w2, pool=True),  # 3x3
            *_block(w2, w3, pool=False),
            nn.AdaptiveMaxPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(w3, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
