"""The order of an epoch: a pure function of ``(seed, epoch)``, cut into disjoint rank shards.

Every loader in trainkit takes its order from here, so resuming at batch ``b`` only needs the
epoch and ``b``: the permutation is recomputed, nothing is replayed. A bounded evaluation
(``trainer.eval_max_batches``) takes its fixed sample here too (:func:`evaluation_sample`).
"""

from __future__ import annotations

import torch

from trainkit.core.errors import ConfigError


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
                world_size: int = 1, sample: int | None = None) -> torch.Tensor:
    """The indices of ``range(n)`` rank ``rank`` visits in ``epoch``, in order (int64, CPU).

    Without shuffling (evaluation), ``sample`` bounds them to :func:`evaluation_sample`'s
    evenly spread indices, shared out among the ranks.
    """
    if not shuffle:
        return evaluation_sample(n, sample)[rank::world_size]
    # One permutation for all ranks, from (seed, epoch) alone; each rank takes a slice.
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=generator)
    per_rank = n // world_size
    return perm[: per_rank * world_size][rank::world_size]


def check_shard(n: int, batch_size: int, *, shuffle: bool, drop_last: bool, rank: int,
                world_size: int, sample: int | None = None) -> None:
    """One-line errors for settings under which a loader could not produce a single batch."""
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
