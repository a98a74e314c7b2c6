"""The model: any ``nn.Module`` taking a batch of images and returning class logits."""

from __future__ import annotations

import torch
from torch import nn


class TinyCNN(nn.Module):
    """Two convolutions and a linear head; the config passes ``channels`` and ``num_classes``."""

    def __init__(self, in_channels: int = 1, channels: int = 16, num_classes: int = 4) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(2), nn.Flatten(),  # 2x2: which half the bar is in
        )
        self.head = nn.Linear(2 * channels * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
