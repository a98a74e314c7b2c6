"""A poisoned data stream for the loss-spike tests: a known batch whose loss explodes.

Batches of a fixed teacher's classification task, the same every epoch; at the ``poison``
indices the inputs are multiplied by 1000 and the labels shifted (a corrupt shard), so that
batch's loss is hundreds of times the others' and one SGD step on it wrecks the weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from trainkit.data.resumable import DataPosition, PositionedLoader

Batch = tuple[torch.Tensor, torch.Tensor]


def batches(n: int, poison: tuple[int, ...] = (), *, split: int = 0, nan: tuple[int, ...] = (),
            size: int = 8, rank: int = 0) -> list[Batch]:
    """``n`` batches of a linear teacher's 3-class task; ``split`` 1 draws other samples of the
    same task (validation), ``rank`` another rank's share; ``poison`` batches scaled by 1000
    and mislabelled, ``nan`` batches holding a NaN."""
    teacher = torch.randn(16, 3, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1 + split + 10 * rank)
    out = []
    for i in range(n):
        x = torch.randn(size, 16, generator=g)
        y = (x @ teacher).argmax(1)
        if i in poison:
            x, y = x * 1000, (y + 1) % 3
        if i in nan:
            x = x.clone()
            x[0, 0] = float("nan")
        out.append((x, y))
    return out


class ListLoader(PositionedLoader):
    """A list of batches served in order, resumable at any batch (trainkit's resume protocol)."""

    def __init__(self, data: list[Batch]) -> None:
        self.data, self.position = data, DataPosition()
        self.batch_size = len(data[0][1])

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self) -> Iterator[Any]:
        for i in range(self.position.begin_pass(), len(self.data)):
            self.position.batch = i + 1
            yield self.data[i]


def net() -> nn.Module:
    """The same small MLP every call (no batch-norm: a scaled input reaches the loss)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))
