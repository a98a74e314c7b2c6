"""The one resumable loader: any batch of any epoch, served to a caller that holds the position.

:class:`ResumableLoader` serves a pass of any epoch from any batch without loading the batches
before it (``batches(epoch, start)``). Its default variant wraps torch's
DataLoader (:func:`make_loader`: workers, pinning, a rank's shard, random transforms seeded per
batch from ``(seed, epoch, rank, batch)``); the in-memory, token and shard loaders are variants
that only say how a pass is served (:meth:`ResumableLoader._pass`). The position has one
holder, the Trainer's state: it asks for ``batches(epoch, batch_in_epoch)`` every epoch, and the
loader's ``state_dict`` keeps only the settings a resume must match.

The order of an epoch is the loader's too: a pure function of ``(seed, epoch)``
(:func:`epoch_order`), cut into disjoint rank shards, so resuming at batch ``b`` only needs the
epoch and ``b``: the permutation is recomputed, nothing is replayed. Every loader takes its order
here; a bounded evaluation (``trainer.eval_max_batches``) its fixed sample
(:func:`evaluation_sample`).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from trainkit.core.device import resolve_device
from trainkit.core.errors import ConfigError, TrainkitError
from trainkit.core.rng import mix_seed
from trainkit.core.signals import shielded_worker_init
from trainkit.data.loader.shm import fit_shared_memory

_SEED_MASK = (1 << 63) - 1  # torch.Generator.manual_seed's range, without wrapping


def pass_seed(seed: int, epoch: int, rank: int) -> int:
    """The seed of a rank's pass over an epoch: one hash per pass; batch ``b`` draws from
    ``pass_seed + b``, as torch seeds its workers ``base_seed + worker_id``."""
    return mix_seed(seed, epoch, rank)


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
    ``pass_seed(seed, epoch, rank) + b``, a function of its place alone (see
    :class:`SeededSamples`).
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
        base = pass_seed(self.seed, self.epoch, self.rank)
        for b in range(start, self.num_batches):
            yield SeededBatch((base + b) & _SEED_MASK, order[b * size:(b + 1) * size])


@runtime_checkable
class ResumableData(Protocol):
    """What a loader needs to resume exactly mid-epoch; every trainkit loader has it.
    ``len()`` is always the whole epoch's batch count."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Any]: ...

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """The next pass (``iter``) serves ``epoch`` from batch ``start_batch`` on."""

    def state_dict(self) -> dict[str, Any]:
        """The settings a resume must match; the position is the caller's, not in here."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Check :meth:`state_dict`'s settings (a saved position, from older runs, is ignored)."""


def set_epoch(data: Any, epoch: int, start_batch: int) -> None:
    """Point any loader at an epoch and, when resuming, a batch inside it.

    A :class:`ResumableData` skips the batches before ``start_batch`` without loading them; any
    other loader with a ``set_epoch(epoch)`` (``DistributedSampler``'s, on the loader or its
    sampler) gets the epoch, and ``start_batch > 0`` is an error for it.
    """
    if isinstance(data, ResumableData):
        data.set_epoch(epoch, start_batch)
        return
    inner = getattr(data, "set_epoch", None) or getattr(getattr(data, "sampler", None),
                                                        "set_epoch", None)
    if inner is not None:
        inner(epoch)
    if start_batch:
        raise TrainkitError(
            f"cannot resume inside an epoch with a {type(data).__name__}: it cannot start at "
            f"batch {start_batch}; use trainkit's loaders or checkpoint at epoch ends"
        )


def pass_of(data: Iterable[Any], epoch: int, start_batch: int = 0) -> Iterator[Any]:
    """The batches ``start_batch, ...`` of ``epoch``, for a caller that holds the position.

    A loader with ``batches(epoch, start)`` (trainkit's) serves them without loading the ones
    before; any other is pointed there with :func:`set_epoch` (``start_batch > 0`` is an error
    for it) and iterated.
    """
    batches = getattr(data, "batches", None)
    if callable(batches):
        return iter(batches(epoch, start_batch))
    set_epoch(data, epoch, start_batch)
    return iter(data)


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


class SeededSamples(Dataset):
    """Wraps a map-style dataset; in a worker, seeds Python, NumPy and torch once per batch.

    A worker's random stream otherwise depends on which batches it loaded before, which changes when
    a run resumes mid-epoch. Seeding from the batch's own seed makes every draw a function of the
    batch's place in the run. Once per batch, not per sample: per sample, seeding would be much of a
    cheap sample's cost. Only torch's CPU generator is seeded (``torch.manual_seed`` also queues
    CUDA seeding, far dearer; workers do not use CUDA; benchmarks/README.md, data figures). In the
    main process (``num_workers=0``) the draws come from the process's own generators, which
    checkpoints save and restore, so no seeding is needed.
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


class ResumableLoader:
    """A loader that serves any batch of any epoch: ``batches(e, b)``, or ``set_epoch(e, b)``
    then ``iter`` (the offset applies to that one pass only).

    It holds no position: the caller (the Trainer's state) knows where it is. Build the
    DataLoader variant with :func:`make_loader`; a variant of another kind
    (:class:`~trainkit.data.InMemoryLoader`, :class:`~trainkit.data.TokenLoader`)
    overrides ``__len__`` and :meth:`_pass` only. ``len()`` is always the whole epoch's batch
    count, also right after a mid-epoch ``set_epoch``.
    """

    epoch: int = 0  # what the next iter() serves (set_epoch), not a saved position
    _start: int = 0
    seed: int = 0
    saved_settings: tuple[str, ...] = ()  # settings in the state a resume must match

    def __init__(self, loader: DataLoader, sampler: ResumableBatchSampler,
                 generator: torch.Generator, *, seed: int, rank: int) -> None:
        self.loader, self.sampler, self._generator = loader, sampler, generator
        self.batch_size, self.drop_last = sampler.batch_size, sampler.drop_last
        self.seed, self._rank = seed, rank
        self.set_epoch(0)

    @property
    def dataset(self) -> Dataset:
        return self.loader.dataset.dataset  # inside SeededSamples

    def __len__(self) -> int:
        return self.sampler.num_batches

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """The next ``iter`` serves ``epoch`` from batch ``start_batch`` on; the batches before
        are never loaded."""
        self.epoch, self._start = epoch, start_batch

    def state_dict(self) -> dict[str, Any]:
        """The :attr:`saved_settings` a resume must match (no position: the caller holds it)."""
        return {key: getattr(self, key) for key in self.saved_settings}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Refuse settings other than :meth:`state_dict`'s; a position in ``state`` (older
        checkpoints saved one) is ignored: the caller resumes with :meth:`batches`."""
        for key in self.saved_settings:
            if state.get(key, getattr(self, key)) != getattr(self, key):
                raise ConfigError(f"loader state has {key} {state[key]}, this loader "
                                  f"{getattr(self, key)}: the order would differ; resume with "
                                  f"the same {key}")

    def __iter__(self) -> Iterator[Any]:
        start, self._start = self._start, 0  # a set_epoch offset applies to one pass
        return self._pass(self.epoch, start)

    def batches(self, epoch: int, start: int = 0) -> Iterator[Any]:
        """The batches ``start, start + 1, ...`` of ``epoch``, for a caller that holds the
        position (the Trainer); what ``iter`` serves next is left alone."""
        return self._pass(epoch, start)

    def _pass(self, epoch: int, start: int) -> Iterator[Any]:
        """The batches ``start, start + 1, ...`` of ``epoch`` (a variant's one job)."""
        self.sampler.set_epoch(epoch, start)  # the sampler skips the batches before `start`
        # Workers' base seeds come from this generator; per-batch seeds (SeededSamples) make
        # transforms exact, this keeps anything else a worker draws tied to (seed, rank, epoch).
        self._generator.manual_seed(mix_seed(self.seed, self._rank, epoch))
        return iter(self.loader)


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
    sampler: ResumableBatchSampler | None = None,
    repeats: int = 1,
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
        sampler: the batches' order when not the dataset's shuffled shard (a mixture's,
            :mod:`trainkit.data.loader.mixture`); its batch size is ``batch_size``.
        repeats: training (``shuffle=True``) only: repeated augmentation, each sample this
            many times in an epoch of the same length, its copies on consecutive ranks and
            augmented apart (``data.repeated_aug``; :func:`~trainkit.data.epoch_order`).

    Raises:
        ConfigError: settings no loader can honour (negative workers, a prefetch factor or
            persistent workers without workers, a batch larger than the shard with drop_last...).
        TrainkitError: ``device`` does not exist here (``cuda`` on a machine without CUDA).

    Example:
        >>> loader = make_loader(dataset, 256, shuffle=True, device="cuda")  # doctest: +SKIP
        >>> loader.set_epoch(2, start_batch=10)  # resume: batches 0-9 are never loaded
    """
    device = torch.device(device)
    sample = max_batches * batch_size * world_size if max_batches else None
    _check_inputs(dataset, batch_size, device, shuffle=shuffle, drop_last=drop_last, rank=rank,
                  world_size=world_size, sample=sample, repeats=repeats)
    num_workers, prefetch_factor, persistent_workers = _workers(
        dataset, batch_size, num_workers, prefetch_factor, persistent_workers, procs_per_node)
    if sampler is None:
        sampler = ResumableBatchSampler(len(dataset), batch_size, shuffle=shuffle,
                                        drop_last=drop_last, seed=seed, rank=rank,
                                        world_size=world_size, sample=sample, repeats=repeats)
    generator = torch.Generator()
    loader = DataLoader(
        SeededSamples(dataset), batch_sampler=sampler, num_workers=num_workers,
        pin_memory=_pinning(pin_memory, device), collate_fn=collate_fn,
        persistent_workers=persistent_workers, prefetch_factor=prefetch_factor,
        generator=generator,
        worker_init_fn=shielded_worker_init(worker_init_fn) if num_workers else None,
    )
    return ResumableLoader(loader, sampler, generator, seed=seed, rank=rank)


def _check_inputs(dataset: Dataset, batch_size: int, device: torch.device, *, shuffle: bool,
                  drop_last: bool, rank: int, world_size: int, sample: int | None,
                  repeats: int = 1) -> None:
    """One line for a dataset, device or shard no loader could serve."""
    if device.type != "cpu":  # a device missing here is the error, not what pinning would need
        resolve_device(device)
    if not isinstance(dataset, Sized):
        raise ConfigError(f"{type(dataset).__name__} has no len(): make_loader needs a "
                          "map-style dataset")
    check_shard(len(dataset), batch_size, shuffle=shuffle, drop_last=drop_last, rank=rank,
                world_size=world_size, sample=sample, repeats=repeats)


def _workers(dataset: Dataset, batch_size: int, num_workers: int | None,
             prefetch_factor: int | None, persistent_workers: bool | None,
             procs_per_node: int | None) -> tuple[int, int | None, bool]:
    """``(num_workers, prefetch_factor, persistent_workers)`` checked, defaulted, and fitted to
    the shared memory the workers' batches in flight need."""
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
    return num_workers, prefetch_factor, persistent_workers


def _pinning(pin_memory: bool | None, device: torch.device) -> bool:
    """Pinned memory: exactly when the batches go to CUDA, unless set (and then possible)."""
    if pin_memory is None:
        return device.type == "cuda"
    if pin_memory and not torch.cuda.is_available():
        raise ConfigError("pin_memory=true needs CUDA, which is not available here; "
                          "leave it unset (null) to pin exactly when training on CUDA")
    return pin_memory
