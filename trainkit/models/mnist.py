"""A small, fast MNIST convnet (its accuracy and time: ``python -m benchmarks.mnist_e2e``)."""

from __future__ import annotations

import torch
from torch import nn


def _block(c_in: int, c_out: int) -> list[nn.Module]:
    # Unpadded: the convolution computes only the positions the pooling keeps (padded, a 7x7 map
    # pooled to 3x3 drops a row and a column of it), and MNIST's digits sit inside a blank border,
    # so the border's positions carry little. Pool before batch-norm and ReLU: they then run on a
    # quarter of the activations, and max-pooling commutes with ReLU.
    return [nn.Conv2d(c_in, c_out, 3, bias=False), nn.MaxPool2d(2), nn.BatchNorm2d(c_out),
            nn.ReLU(inplace=True)]


class MnistNet(nn.Module):
    """Space-to-depth stem, two unpadded conv blocks, a dense layer, linear head; 28x28 inputs.

    The stem folds each 2x2 patch into 4 channels (28x28x1 -> 14x14x4), so no convolution runs at
    full resolution: one-channel convolutions are the slowest kind on CPUs. The blocks take
    14x14 to 6x6 and then 2x2; the dense layer reads that whole 2x2 map (a 2x2 convolution
    over it, computed as the matrix product it is).

    Args:
        widths: channels of the two conv blocks and units of the dense layer.
        num_classes: outputs of the head.

    Example:
        >>> MnistNet().eval()(torch.randn(2, 1, 28, 28)).shape
        torch.Size([2, 10])
    """

    def __init__(self, widths: tuple[int, int, int] = (32, 96, 256), num_classes: int = 10) -> None:
        super().__init__()
        w1, w2, w3 = widths
        self.features = nn.Sequential(
            nn.PixelUnshuffle(2),  # 14x14x4
            *_block(4, w1),  # 12x12 -> 6x6
            *_block(w1, w2),  # 4x4 -> 2x2
            nn.Flatten(),
            nn.Linear(4 * w2, w3, bias=False),
            nn.BatchNorm1d(w3),
            nn.ReLU(inplace=True),
        )
        self.head = nn.Linear(w3, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
