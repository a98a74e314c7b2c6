"""The order of an epoch: a pure function of ``(seed, epoch)``, cut into disjoint rank shards.

Every loader in trainkit takes its order from here, so resuming at batch ``b`` only needs the
epoch and ``b``: the permutation is recomputed, nothing is replayed. A bounded evaluation
(``trainer.eval_max_batches``) takes its fixed sample here too (:func:`evaluation_sample`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch.utils.data import Sampler

from trainkit.core.errors import ConfigError
from trainkit.core.rng import mix_seed


def evaluation_sample(n: int, size: int | None) -> torch.Tensor:
    """``size`` indices of ``range(n)`` spread evenly over it, in order (all of them when
    ``size`` is None or not smaller): a bounded evaluation's sample, the same at every
    evaluation and in every run, and representative of a split stored in any order (an image
    folder's classes one after the other, a corpus whose parts differ)."""
    if size is None or size >= n:
        return torch.arange(n)
    return (torch.arange(size) * 2 + 1) * n // (2 * size)  # the middles of size equal parts


def shard_size(n: int, *, shuffle: bool, rank: int, world_size: int,
               sample: int | None = None) -> int:
    """Samples rank ``rank`` sees per epoch.

    When shuffling (training) the epoch is cut to a multiple of ``world_size`` so every rank runs
    the same number of steps; without (evaluation) every sample (of ``sample``, when given) is
    kept exactly once.
    """
    if shuffle:
        return n // world_size
    return len(range(rank, min(n, sample or n), world_size))


def epoch_order(n: int, *, seed: int, epoch: int, shuffle: bool, rank: int = 0,
                world_size: int = 1, sample: int | None = None,
                repeats: int = 1) -> torch.Tensor:
    """The indices of ``range(n)`` rank ``rank`` visits in ``epoch``, in order (int64, CPU).

    Without shuffling (evaluation), ``sample`` bounds them to :func:`evaluation_sample`'s
    evenly spread indices, shared out among the ranks. ``repeats`` (training: repeated
    augmentation, as timm's ``RepeatAugSampler``) takes each index of the permutation that many
    times in a row, so its copies go to consecutive ranks (augmented apart); the epoch keeps its
    length, ``n // world_size`` per rank, and so covers ``1 / repeats`` of the samples.
    """
    if not shuffle:
        return evaluation_sample(n, sample)[rank::world_size]
    # One permutation for all ranks, from (seed, epoch) alone; each rank takes a slice.
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=generator)
    if repeats > 1:
        perm = perm.repeat_interleave(repeats)
    per_rank = n // world_size
    return perm[: per_rank * world_size][rank::world_size]


def check_shard(n: int, batch_size: int, *, shuffle: bool, drop_last: bool, rank: int,
                world_size: int, sample: int | None = None, repeats: int = 1) -> None:
    """One-line errors for settings under which a loader could not produce a single batch."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"repeats must be a positive integer, got {repeats!r}")
    if repeats > 1 and not shuffle:
        raise ConfigError("repeated augmentation (repeats > 1) is for training loaders: they "
                          "shuffle")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is not in 0..{world_size - 1} (world size {world_size})")
    if n == 0:
        raise ConfigError("the dataset is empty")
    if sample is not None and shuffle:
        raise ConfigError("a bounded sample (max_batches) is for evaluation loaders: they do "
                          "not shuffle")
    size = shard_size(n, shuffle=shuffle, rank=rank, world_size=world_size, sample=sample)
    if size == 0:
        raise ConfigError(f"{n} samples cannot be shared among {world_size} ranks: "
                          f"rank {rank} gets none; use fewer processes")
    if drop_last and batch_size > size:
        raise ConfigError(
            f"batch_size={batch_size} is larger than this rank's {size} samples and drop_last is "
            "on: an epoch would have no batch; lower the batch size or turn drop_last off"
        )


class SeededBatch(NamedTuple):
    """One batch as the sampler hands it to a worker: its indices, and the seed of its draws."""

    seed: int
    indices: list[int]


class ResumableBatchSampler(Sampler[SeededBatch]):
    """Batches of this rank's shard in an order fixed by ``(seed, epoch)``, each with a seed.

    Like ``DistributedSampler`` + ``BatchSampler`` but resumable: ``set_epoch(epoch, start)``
    makes the next pass start at batch ``start`` of the shard, without touching the batches
    before it. ``len()`` is the batches left in that pass. Batch ``b`` carries the seed
    ``mix_seed(seed, epoch, rank, b)``, a function of its place alone (see :class:`SeededSamples`).
    Without shuffling, ``sample`` bounds an epoch to that many samples spread evenly over the
    dataset (:func:`evaluation_sample`); with, ``repeats`` is :func:`epoch_order`'s.
    """

    def __init__(self, n: int, batch_size: int, *, shuffle: bool, drop_last: bool = False,
                 seed: int = 0, rank: int = 0, world_size: int = 1,
                 sample: int | None = None, repeats: int = 1) -> None:
        self.n, self.batch_size, self.shuffle, self.drop_last = n, batch_size, shuffle, drop_last
        self.seed, self.rank, self.world_size, self.sample = seed, rank, world_size, sample
        self.repeats = repeats
        self.epoch = 0
        self.start = 0

    @property
    def num_samples(self) -> int:
        """Samples of this rank's whole shard per epoch."""
        return shard_size(self.n, shuffle=self.shuffle, rank=self.rank,
                          world_size=self.world_size, sample=self.sample)

    @property
    def num_batches(self) -> int:
        """Batches of this rank's whole shard per epoch."""
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Serve ``epoch`` from batch ``start`` on (for the next pass only)."""
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return max(0, self.num_batches - self.start)

    def __iter__(self) -> Iterator[SeededBatch]:
        order = epoch_order(self.n, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle,
                            rank=self.rank, world_size=self.world_size,
                            sample=self.sample, repeats=self.repeats).tolist()
        start, self.start = self.start, 0
        size = self.batch_size
        for b in range(start, self.num_batches):
            yield SeededBatch(mix_seed(self.seed, self.epoch, self.rank, b),
                              order[b * size:(b + 1) * size])
