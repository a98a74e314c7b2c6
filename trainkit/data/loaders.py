"""A DataLoader factory for map-style datasets, with resumable, rank-sharded sampling.

The standard path, done right: pinned memory when the batches go to CUDA, a worker count from the
CPUs each process on the node gets, an order that can restart at any batch of any epoch without
loading the batches before it, and random transforms in workers seeded once per batch from
``(seed, epoch, rank, batch)``, so a resumed run sees exactly the samples an uninterrupted one
would, at the speed of a plain DataLoader (``python -m benchmarks.loaders`` measures both).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator, Sized
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from trainkit.core.device import resolve_device
from trainkit.core.errors import ConfigError
from trainkit.core.rng import mix_seed
from trainkit.core.signals import shielded_worker_init
from trainkit.data.order import check_shard, epoch_order, shard_size
from trainkit.data.resumable import DataPosition, PositionedLoader
from trainkit.data.shm import fit_shared_memory


def default_num_workers(procs_per_node: int | None = None) -> int:
    """Loader workers per process: the CPUs this process may use, shared among the processes on
    the node (``LOCAL_WORLD_SIZE`` under torchrun), less one for the process itself; at most 8.
    """
    if procs_per_node is None:
        procs_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    try:
        cpus = len(os.sched_getaffinity(0))  # respects taskset / cgroup CPU sets
    except AttributeError:  # pragma: no cover - macOS, Windows
        cpus = os.cpu_count() or 1
    return max(0, min(8, cpus // max(1, procs_per_node) - 1))


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
    dataset (:func:`~trainkit.data.order.evaluation_sample`).
    """

    def __init__(self, n: int, batch_size: int, *, shuffle: bool, drop_last: bool = False,
                 seed: int = 0, rank: int = 0, world_size: int = 1,
                 sample: int | None = None) -> None:
        self.n, self.batch_size, self.shuffle, self.drop_last = n, batch_size, shuffle, drop_last
        self.seed, self.rank, self.world_size, self.sample = seed, rank, world_size, sample
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
                            sample=self.sample).tolist()
        start, self.start = self.start, 0
        size = self.batch_size
        for b in range(start, self.num_batches):
            yield SeededBatch(mix_seed(self.seed, self.epoch, self.rank, b),
                              order[b * size:(b + 1) * size])


class SeededSamples(Dataset):
    """Wraps a map-style dataset; in a worker, seeds Python, NumPy and torch once per batch.

    A worker's random stream otherwise depends on which batches it loaded before, which changes
    when a run resumes mid-epoch. Seeding from the batch's own seed makes every draw a function
    of the batch's place in the run. Once per batch, not per sample: seeding costs microseconds,
    which per sample would be most of a cheap sample's cost. Only torch's CPU generator is
    seeded (``torch.manual_seed`` also queues CUDA seeding, ~100x slower; workers do not use
    CUDA). In the main process (``num_workers=0``) the draws come from the process's own
    generators, which checkpoints save and restore, so no seeding is needed.
    """

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, batch: SeededBatch) -> list[Any]:
        # The DataLoader's fetcher hands a whole batch here (torch >= 2.0 calls __getitems__).
        if get_worker_info() is not None:
            random.seed(batch.seed)
            np.random.seed(batch.seed % 2**32)
            torch.default_generator.manual_seed(batch.seed)
        many = getattr(self.dataset, "__getitems__", None)
        return many(batch.indices) if many else [self.dataset[i] for i in batch.indices]


class ResumableLoader(PositionedLoader):
    """A ``DataLoader`` the Trainer can point at any batch of any epoch: ``set_epoch(e, b)``.

    Build it with :func:`make_loader`. Iterating yields the DataLoader's batches; ``len()`` is
    always the whole epoch's batch count, also right after a mid-epoch ``set_epoch``.
    """

    def __init__(self, loader: DataLoader, sampler: ResumableBatchSampler,
                 generator: torch.Generator, *, seed: int, rank: int) -> None:
        self.loader = loader
        self.sampler = sampler
        self.batch_size = sampler.batch_size
        self.drop_last = sampler.drop_last
        self._generator = generator
        self._seed, self._rank = seed, rank
        self.position = DataPosition()
        self.set_epoch(0)

    @property
    def dataset(self) -> Dataset:
        return self.loader.dataset.dataset  # inside SeededSamples

    def __len__(self) -> int:
        return self.sampler.num_batches

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Serve ``epoch`` from batch ``start_batch`` on; the batches before are never loaded."""
        super().set_epoch(epoch, start_batch)
        self.sampler.set_epoch(epoch, start_batch)
        # Workers' base seeds come from this generator; per-batch seeds (SeededSamples) make
        # transforms exact, this keeps anything else a worker draws tied to (seed, rank, epoch).
        self._generator.manual_seed(mix_seed(self._seed, self._rank, epoch))

    def __iter__(self) -> Iterator[Any]:
        self.position.begin_pass()  # the sampler skips the batches before it
        for batch in self.loader:
            self.position.batch += 1
            yield batch


def make_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    shuffle: bool,
    device: torch.device | str = "cpu",
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    num_workers: int | None = None,
    pin_memory: bool | None = None,
    persistent_workers: bool | None = None,
    prefetch_factor: int | None = None,
    drop_last: bool = False,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    worker_init_fn: Callable[[int], None] | None = None,
    procs_per_node: int | None = None,
    max_batches: int | None = None,
) -> ResumableLoader:
    """A DataLoader over a map-style ``dataset`` with the settings a careful user would pick.

    Args:
        dataset: any map-style dataset (``__getitem__`` and ``__len__``).
        batch_size: samples per batch on this rank.
        shuffle: a new order every epoch, fixed by ``(seed, epoch)``.
        device: where batches will go; pinned memory is used when it is CUDA.
        seed: fixes the order and, with rank and epoch, the workers' random streams.
        rank, world_size: each rank gets a disjoint shard (when shuffling, cut to equal sizes).
        num_workers: worker processes; None picks :func:`default_num_workers`.
        pin_memory: None means on exactly when ``device`` is CUDA.
        persistent_workers: keep workers between epochs; None means on whenever there are any.
        prefetch_factor: batches each worker loads ahead; None leaves torch's default (2).
        drop_last: drop a last batch smaller than ``batch_size``.
        collate_fn: how samples become a batch; None is torch's default.
        worker_init_fn: your own ``worker_init_fn(worker_id)``; it runs in each worker after
            trainkit's, which makes the worker survive preemption signals sent to the whole
            process group (the main process stops the run and then the workers).
        procs_per_node: processes sharing this node's CPUs (default: ``LOCAL_WORLD_SIZE``).
        max_batches: evaluation (``shuffle=False``) only: at most this many batches per rank,
            of samples spread evenly over the dataset, the same every pass
            (``trainer.eval_max_batches``); None: the whole dataset.

    Raises:
        ConfigError: settings no loader can honour (negative workers, a prefetch factor or
            persistent workers without workers, a batch larger than the shard with drop_last...).
        TrainkitError: ``device`` does not exist here (``cuda`` on a machine without CUDA).

    Example:
        >>> loader = make_loader(dataset, 256, shuffle=True, device="cuda")  # doctest: +SKIP
        >>> loader.set_epoch(2, start_batch=10)  # resume: batches 0-9 are never loaded
    """
    device = torch.device(device)
    if device.type != "cpu":  # a device missing here is the error, not what pinning would need
        resolve_device(device)
    if not isinstance(dataset, Sized):
        raise ConfigError(f"{type(dataset).__name__} has no len(): make_loader needs a "
                          "map-style dataset")
    sample = max_batches * batch_size * world_size if max_batches else None
    check_shard(len(dataset), batch_size, shuffle=shuffle, drop_last=drop_last, rank=rank,
                world_size=world_size, sample=sample)
    if num_workers is None:
        num_workers = default_num_workers(procs_per_node)
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ConfigError(f"num_workers must be an integer >= 0, got {num_workers!r}")
    if num_workers == 0 and prefetch_factor is not None:
        raise ConfigError(f"prefetch_factor={prefetch_factor} needs worker processes, but "
                          "num_workers=0 loads in the main process; drop one of the two")
    if prefetch_factor is not None and prefetch_factor < 1:
        raise ConfigError(f"prefetch_factor must be >= 1, got {prefetch_factor}")
    if num_workers == 0 and persistent_workers:
        raise ConfigError("persistent_workers=true needs num_workers >= 1")
    if persistent_workers is None:
        persistent_workers = num_workers > 0
    # Workers' batches in flight must fit in /dev/shm (64 MB in a default Docker container).
    num_workers, prefetch_factor = fit_shared_memory(dataset, batch_size, num_workers,
                                                     prefetch_factor)
    if pin_memory is None:
        pin_memory = device.type == "cuda"
    if pin_memory and not torch.cuda.is_available():
        raise ConfigError("pin_memory=true needs CUDA, which is not available here; "
                          "leave it unset (null) to pin exactly when training on CUDA")
    sampler = ResumableBatchSampler(len(dataset), batch_size, shuffle=shuffle,
                                    drop_last=drop_last, seed=seed, rank=rank,
                                    world_size=world_size, sample=sample)
    generator = torch.Generator()
    loader = DataLoader(
        SeededSamples(dataset), batch_sampler=sampler, num_workers=num_workers,
        pin_memory=pin_memory, collate_fn=collate_fn, persistent_workers=persistent_workers,
        prefetch_factor=prefetch_factor, generator=generator,
        worker_init_fn=shielded_worker_init(worker_init_fn) if num_workers else None,
    )
    return ResumableLoader(loader, sampler, generator, seed=seed, rank=rank)

