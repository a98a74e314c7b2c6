"""Datasets and models for the probe and advice tests: slow samples, fast ones, a light and a
heavy model.

Both are readers for the entry point's ``dataset._target_`` (``reader(root, train)`` returns a
:class:`~trainkit.TensorData`). The slow one's images sleep in ``__getitem__``: each
sample read by the DataLoader path costs ``SLEEP_S``, as a decoded JPEG would; the in-memory
loader gathers a whole batch with one index and pays it once a batch.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from trainkit.data.sources.tensors import TensorData

SLEEP_S = 0.004


class SlowImages(torch.Tensor):
    """uint8 images whose indexing sleeps, as reading and decoding a file would."""

    def __getitem__(self, index):  # type: ignore[override]
        time.sleep(SLEEP_S)
        return super().__getitem__(index).as_subclass(torch.Tensor)  # plain from here on


def _images(n: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=gen)
    images = torch.randint(0, 256, (n, 3, size, size), generator=gen, dtype=torch.uint8)
    return images, labels


def slow_reader(root: str = "", train: bool = True, n: int = 512) -> TensorData:
    """Random 8x8 RGB images whose samples each take ``SLEEP_S`` to read."""
    images, labels = _images(n if train else 64, 8, 0 if train else 1)
    return TensorData(images.as_subclass(SlowImages), labels, (0.5,) * 3, (0.25,) * 3, 10)


def fast_reader(root: str = "", train: bool = True, n: int = 512, size: int = 8) -> TensorData:
    """Random RGB images in memory, read at memory speed."""
    images, labels = _images(n if train else 64, size, 0 if train else 1)
    return TensorData(images, labels, (0.5,) * 3, (0.25,) * 3, 10)


class TinyNet(nn.Module):
    """A linear classifier of 3x8x8 images: its step takes next to nothing."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class HeavyNet(nn.Module):
    """Wide 3x3 convolutions at full resolution: many milliseconds a step on a CPU core."""

    def __init__(self, num_classes: int = 10, width: int = 96) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ReadingNet(TinyNet):
    """TinyNet that reads a value back to the host in every forward, as ``loss.item()`` would."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.last_mean = out.mean().item()  # a host sync on a GPU, every step
        return out
