"""MixUp and CutMix on training batches, on the device (``data.mixup``, ``data.cutmix``).

torchvision.transforms.v2's ``MixUp`` / ``CutMix`` (one of them per batch, by ``RandomChoice``,
when both are set) on each ``(images, labels)`` batch the training loader hands out, after the
device stage: the labels become class probabilities, which ``cross_entropy`` takes (label
smoothing included). Only the training loader is wrapped: evaluation keeps hard labels.

The draws of batch ``b`` of epoch ``e`` come from torch's CPU generator seeded by ``(seed, rank,
e, b)`` for that batch alone (and restored after), so a run resumed mid-epoch mixes its
batches as the uninterrupted run did, and the training's own draws (dropout) are untouched.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from trainkit.core.rng import mix_seed
from trainkit.data.loader.resumable import pass_of


def batch_mixing(num_classes: int, *, mixup: float = 0.0,
                 cutmix: float = 0.0) -> Any | None:
    """torchvision's MixUp (Beta ``mixup``), CutMix (Beta ``cutmix``), or a random choice of
    the two, for ``(images, labels)`` batches of ``num_classes`` classes; None when both are 0."""
    from torchvision.transforms import v2

    mixes = [kind(alpha=float(alpha), num_classes=num_classes)
             for kind, alpha in ((v2.MixUp, mixup), (v2.CutMix, cutmix)) if alpha > 0]
    if not mixes:
        return None
    return mixes[0] if len(mixes) == 1 else v2.RandomChoice(mixes)


class MixedBatches:
    """The training loader ``data`` whose ``(images, labels)`` batches are mixed by ``mix``.

    Keeps the loader's protocol: ``len``, ``batches(epoch, start)`` (what the fit asks for),
    ``set_epoch`` + ``iter``, ``state_dict`` / ``load_state_dict``; its other attributes are the
    loader's.
    """

    def __init__(self, data: Any, mix: Any, *, seed: int, rank: int = 0) -> None:
        self.data, self.mix, self.seed, self.rank = data, mix, seed, rank
        self._epoch, self._batch = 0, 0

    def __len__(self) -> int:
        return len(self.data)

    def __getattr__(self, name: str) -> Any:  # batch_size, classes, report, ...
        if name == "data":
            raise AttributeError(name)
        return getattr(self.data, name)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """The next ``iter`` serves ``epoch`` from ``start_batch``, mixed by position."""
        self._epoch, self._batch = epoch, start_batch

    def state_dict(self) -> dict[str, Any]:
        """The loader's state."""
        return self.data.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The loader's state (it holds no position: the fit asks for :meth:`batches`)."""
        self.data.load_state_dict(state)

    def batches(self, epoch: int, start_batch: int = 0) -> Iterator[Any]:
        """Batches ``start_batch, ...`` of ``epoch``, each mixed by its own position."""
        for index, batch in enumerate(pass_of(self.data, epoch, start_batch), start_batch):
            yield self.mixed(batch, epoch, index)

    def __iter__(self) -> Iterator[Any]:
        epoch, start = self._epoch, self._batch
        self._epoch, self._batch = epoch + 1, 0
        yield from self.batches(epoch, start)

    def mixed(self, batch: Any, epoch: int, index: int) -> Any:
        """``batch`` (``(images, labels)``) mixed with the draws of batch ``index`` of
        ``epoch``: the same batch and position give the same result."""
        images, labels = batch
        with torch.random.fork_rng(devices=[]):  # the CPU generator only, restored after
            torch.default_generator.manual_seed(mix_seed(self.seed, self.rank, epoch, index))
            return self.mix(images, labels)
