"""Loaders that feed the device: batches gathered by index from tensors held in memory.

Each epoch's order is a pure function of ``(seed, epoch)``, so resuming at batch ``b`` of an epoch
costs nothing: the loader recomputes the permutation and starts at ``b``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from trainkit.config import DataConfig
from trainkit.datasets import TensorData, load_mnist
from trainkit.errors import ConfigError
from trainkit.runtime import Runtime


class InMemoryLoader:
    """Batches ``(images, labels)`` from a :class:`TensorData`, normalised on the device.

    The uint8 data is moved to ``device`` once (GPU-resident on CUDA: no host copies per step);
    every batch is one index gather plus a cast and normalisation there.

    Args:
        data: the split to serve.
        batch_size: samples per batch on this rank.
        shuffle: a new order every epoch (training); ``False`` keeps file order (evaluation).
        drop_last: drop a last batch smaller than ``batch_size``.
        seed: with the epoch, fixes the order.
        device: where batches are produced.
        rank, world_size: each rank serves a disjoint shard. When shuffling, the epoch is cut to a
            multiple of ``world_size`` so every rank runs the same number of steps; evaluation
            keeps every sample exactly once.
        channels_last: produce NHWC-strided batches (faster convolutions on CPU and GPU).

    Example:
        >>> loader = InMemoryLoader(data, 128, shuffle=True, device="cpu")  # doctest: +SKIP
        >>> loader.set_epoch(3)
        >>> x, y = next(iter(loader))
    """

    def __init__(
        self,
        data: TensorData,
        batch_size: int,
        *,
        shuffle: bool,
        drop_last: bool = False,
        seed: int = 0,
        device: torch.device | str = "cpu",
        rank: int = 0,
        world_size: int = 1,
        channels_last: bool = False,
    ) -> None:
        self.device = torch.device(device)
        self.images = data.images.to(self.device)
        self.labels = data.labels.to(self.device)
        shape = (1, -1, 1, 1)
        self._mean = torch.tensor(data.mean, device=self.device).view(shape) * 255
        self._std = torch.tensor(data.std, device=self.device).view(shape) * 255
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.channels_last = channels_last
        self.epoch = 0
        self._start = 0

    @property
    def num_samples(self) -> int:
        """Samples this rank sees per epoch."""
        n = len(self.labels)
        if self.shuffle:
            return n // self.world_size
        return len(range(self.rank, n, self.world_size))

    def __len__(self) -> int:
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Serve epoch ``epoch`` from batch ``start_batch`` on (constant time: no replay)."""
        self.epoch = epoch
        self._start = start_batch

    def order(self, epoch: int) -> torch.Tensor:
        """The sample indices this rank visits in ``epoch``, in order."""
        n = len(self.labels)
        if not self.shuffle:
            return torch.arange(self.rank, n, self.world_size)
        # One permutation for all ranks, from (seed, epoch) alone; each rank takes a slice.
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(n, generator=generator)
        return perm[: self.num_samples * self.world_size][self.rank :: self.world_size]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = self.order(self.epoch).to(self.device)
        start, self._start = self._start, 0  # a resume offset applies to one pass only
        for b in range(start, len(self)):
            yield self._batch(order[b * self.batch_size : (b + 1) * self.batch_size])

    def _batch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.images[index].float().sub_(self._mean).div_(self._std)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, self.labels[index]


def build_loaders(
    cfg: DataConfig, runtime: Runtime, *, seed: int = 0, channels_last: bool = False
) -> tuple[InMemoryLoader, InMemoryLoader, int]:
    """Training and evaluation loaders for the dataset ``cfg.name``, and its number of classes.

    Raises:
        ConfigError: an unknown dataset name.
        TrainkitError: the files are missing (offline), corrupt or malformed.
    """
    readers = {"mnist": load_mnist}
    if cfg.name not in readers:
        raise ConfigError(f"data.name={cfg.name!r} is not one of {', '.join(readers)}")
    read = readers[cfg.name]
    train = read(cfg.root, train=True, verify=cfg.verify, download=cfg.download)
    test = read(cfg.root, train=False, verify=cfg.verify, download=cfg.download)
    common = {"device": runtime.device, "rank": runtime.rank, "world_size": runtime.world_size,
              "channels_last": channels_last}
    return (
        InMemoryLoader(train, cfg.batch_size, shuffle=True, seed=seed, **common),
        InMemoryLoader(test, cfg.eval_batch_size, shuffle=False, **common),
        train.num_classes,
    )
