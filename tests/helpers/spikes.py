"""A poisoned data stream for the loss-spike tests: a known batch whose loss explodes.

Batches of a fixed teacher's classification task, the same every epoch; at the ``poison``
indices the inputs are multiplied by 1000 and the labels shifted (a corrupt shard), so that
batch's loss is hundreds of times the others' and one SGD step on it wrecks the weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from trainkit.data.loader.resumable import ResumableLoader

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


class ListLoader(ResumableLoader):
    """A list of batches served in order, resumable at any batch (trainkit's resume protocol)."""

    def __init__(self, data: list[Batch]) -> None:
        self.data = data
        self.batch_size = len(data[0][1])

    def __len__(self) -> int:
        return len(self.data)

    def _pass(self, epoch: int, start: int) -> Iterator[Any]:
        return iter(self.data[start:])


def net() -> nn.Module:
    """The same small MLP every call (no batch-norm: a scaled input reaches the loss)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))


class PoisonedImages(torch.utils.data.Dataset):
    """A torch Dataset for the entry point (``dataset._target_``): 3x8x8 float images of a
    linear teacher's classes; with ``poison``, those training samples scaled by 1000 and
    mislabelled (the batch holding one has a loss hundreds of times the others')."""

    classes: ClassVar[list[str]] = ["a", "b", "c"]

    def __init__(self, root: str = "", train: bool = True, n: int = 640,
                 poison: tuple[int, ...] = ()) -> None:
        teacher = torch.randn(3 * 8 * 8, 3, generator=torch.Generator().manual_seed(0))
        g = torch.Generator().manual_seed(1 if train else 2)
        self.images = torch.randn(n if train else 128, 3, 8, 8, generator=g)
        self.labels = (self.images.flatten(1) @ teacher).argmax(1)
        for i in poison if train else ():
            self.images[i] *= 1000
            self.labels[i] = (self.labels[i] + 1) % 3

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.labels[index])
