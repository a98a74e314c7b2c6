"""The order of an epoch: a pure function of ``(seed, epoch)``, cut into disjoint rank shards.

Every loader in trainkit takes its order from here, so resuming at batch ``b`` only needs the
epoch and ``b``: the permutation is recomputed, nothing is replayed.
"""

from __future__ import annotations

import torch

from trainkit.core.errors import ConfigError


def shard_size(n: int, *, shuffle: bool, rank: int, world_size: int) -> int:
    """Samples rank ``rank`` sees per epoch.

    When shuffling (training) the epoch is cut to a multiple of ``world_size`` so every rank runs
    the same number of steps; without (evaluation) every sample is kept exactly once.
    """
    if shuffle:
        return n // world_size
    return len(range(rank, n, world_size))


def epoch_order(n: int, *, seed: int, epoch: int, shuffle: bool, rank: int = 0,
                world_size: int = 1) -> torch.Tensor:
    """The indices of ``range(n)`` rank ``rank`` visits in ``epoch``, in order (int64, CPU)."""
    if not shuffle:
        return torch.arange(rank, n, world_size)
    # One permutation for all ranks, from (seed, epoch) alone; each rank takes a slice.
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=generator)
    per_rank = n // world_size
    return perm[: per_rank * world_size][rank::world_size]


def check_shard(n: int, batch_size: int, *, shuffle: bool, drop_last: bool, rank: int,
                world_size: int) -> None:
    """One-line errors for settings under which a loader could not produce a single batch."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is not in 0..{world_size - 1} (world size {world_size})")
    if n == 0:
        raise ConfigError("the dataset is empty")
    size = shard_size(n, shuffle=shuffle, rank=rank, world_size=world_size)
    if size == 0:
        raise ConfigError(f"{n} samples cannot be shared among {world_size} ranks: "
                          f"rank {rank} gets none; use fewer processes")
    if drop_last and batch_size > size:
        raise ConfigError(
            f"batch_size={batch_size} is larger than this rank's {size} samples and drop_last is "
            "on: an epoch would have no batch; lower the batch size or turn drop_last off"
        )
