"""MNIST-like synthetic digits for the research examples: offline, in memory, seconds to learn.

Ten classes, each a fixed random pattern of strokes on a 12x12 grid, drawn at one of three
horizontal shifts (-1, 0, +1 pixel: a second label, for the multi-task example) under noise;
uint8 images in a :class:`trainkit.TensorData`, so trainkit's :class:`~trainkit.InMemoryLoader`
serves them and resumes mid-epoch. ``labels`` = ``digit * 3 + shift``.
"""

from __future__ import annotations

import torch

from trainkit import TensorData

SIZE, CLASSES, SHIFTS = 12, 10, 3


def digits(n: int, seed: int) -> TensorData:
    """``n`` samples; ``seed`` picks the samples, never the classes' patterns (fixed)."""
    g = torch.Generator().manual_seed(1234)
    patterns = (torch.rand(CLASSES, SIZE, SIZE, generator=g) < 0.3).float()
    g = torch.Generator().manual_seed(seed)
    digit = torch.randint(0, CLASSES, (n,), generator=g)
    shift = torch.randint(0, SHIFTS, (n,), generator=g)
    images = torch.stack([patterns[d].roll(int(s) - 1, dims=1) for d, s in zip(digit, shift)])
    images = (images * 0.6 + 0.6 * torch.randn(n, SIZE, SIZE, generator=g)).clamp(0, 1)
    return TensorData(images=(images * 255).round().to(torch.uint8).unsqueeze(1),
                      labels=digit * SHIFTS + shift, mean=(0.3,), std=(0.3,),
                      num_classes=CLASSES * SHIFTS)


def digit_of(labels: torch.Tensor) -> torch.Tensor:
    return labels // SHIFTS


def shift_of(labels: torch.Tensor) -> torch.Tensor:
    return labels % SHIFTS
