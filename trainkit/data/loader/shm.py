"""Shared memory for DataLoader workers: ``/dev/shm`` must hold the batches they have in flight.

Workers hand each batch to the main process in shared memory (``/dev/shm`` on Linux). Docker gives
a container 64 MB there unless started with ``--shm-size`` or ``--ipc=host``; workers that run out
die with "bus error" or "No space left on device" in the middle of a run. :func:`fit_shared_memory`
checks before any worker starts and lowers the prefetch, then the workers, to what fits (with a
warning naming the fix), or stops with one line when not even one batch fits.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from trainkit.core.device import GIB
from trainkit.core.errors import ConfigError

log = logging.getLogger("trainkit")

SHM_PATH = "/dev/shm"
DEFAULT_PREFETCH = 2  # torch's DataLoader default for prefetch_factor
# Above this much free shared memory (a host's: half its RAM) no sample is read to size the
# batches: only unusual batches would not fit, and reading one in the main process is not free
# (a lazily opened HDF5 file, for one, is better first opened in the workers).
CHECK_BELOW_BYTES = 4 * GIB


def shm_free_bytes(path: str = SHM_PATH) -> int | None:
    """Free bytes in the shared-memory filesystem; None where there is none (macOS, Windows)."""
    try:
        stats = os.statvfs(path)
    except (OSError, AttributeError):
        return None
    return stats.f_bavail * stats.f_frsize


def plan_workers(batch_bytes: int, num_workers: int, prefetch_factor: int,
                 free_bytes: int | None) -> tuple[int, int, str | None]:
    """The workers and prefetch factor whose batches in flight fit in ``free_bytes``.

    Workers hold up to ``num_workers x prefetch_factor`` batches in shared memory. When they do
    not fit, the prefetch factor is lowered first (it rarely limits throughput), then the
    workers, keeping at least one of each.

    Returns:
        ``(num_workers, prefetch_factor, warning)``; ``warning`` is None when nothing changed.

    Raises:
        ConfigError: not even one batch of one worker fits.

    Example:
        >>> plan_workers(40 * 2**20, 4, 2, free_bytes=64 * 2**20)[:2]
        (1, 1)
    """
    need = batch_bytes * num_workers * prefetch_factor
    if free_bytes is None or need <= free_bytes:
        return num_workers, prefetch_factor, None
    fix = f"start the container with --shm-size={_size_flag(need)} or --ipc=host"
    if batch_bytes > free_bytes:
        raise ConfigError(
            f"{SHM_PATH} has {_mib(free_bytes)} free, less than one batch ({_mib(batch_bytes)}): "
            f"DataLoader workers would die with a bus error; {fix}, or set num_workers=0")
    per_worker = free_bytes // batch_bytes  # batches that fit, spread over the workers
    workers = min(num_workers, per_worker)
    prefetch = min(prefetch_factor, per_worker // workers)
    warning = (f"{SHM_PATH} has {_mib(free_bytes)} free but {num_workers} workers x prefetch "
               f"{prefetch_factor} x {_mib(batch_bytes)} batches need {_mib(need)}: using "
               f"{workers} workers x prefetch {prefetch}; to keep them, {fix}")
    return workers, prefetch, warning


def fit_shared_memory(dataset: Any, batch_size: int, num_workers: int,
                      prefetch_factor: int | None, *,
                      free_bytes: int | None = None) -> tuple[int, int | None]:
    """:func:`plan_workers` for ``dataset``, sized from its first sample; logs any change.

    ``free_bytes`` defaults to what ``/dev/shm`` has free now; from ``CHECK_BELOW_BYTES`` up
    nothing is checked. Reading the sample leaves the global random generators as they were (a
    random transform must not shift the run's draws).

    Returns:
        ``(num_workers, prefetch_factor)`` for the DataLoader; the prefetch factor stays None
        (torch's default) when nothing had to change.
    """
    free_bytes = shm_free_bytes() if free_bytes is None else free_bytes
    if not num_workers or free_bytes is None or free_bytes >= CHECK_BELOW_BYTES or not len(dataset):
        return num_workers, prefetch_factor
    with _random_state_kept():
        try:
            batch_bytes = _nbytes(dataset[0]) * batch_size
        except Exception:  # the workers will raise it, naming the index, when they load it
            return num_workers, prefetch_factor
    asked = DEFAULT_PREFETCH if prefetch_factor is None else prefetch_factor
    workers, prefetch, warning = plan_workers(batch_bytes, num_workers, asked, free_bytes)
    if warning is None:
        return num_workers, prefetch_factor
    log.warning("%s", warning)
    return workers, prefetch


def _nbytes(sample: Any) -> int:
    """Bytes of the tensors and arrays in a (nested) sample; a collated batch is ~n times it."""
    if isinstance(sample, torch.Tensor):
        return sample.numel() * sample.element_size()
    if isinstance(sample, np.ndarray):
        return sample.nbytes
    if isinstance(sample, Mapping):
        return sum(_nbytes(value) for value in sample.values())
    if isinstance(sample, (list, tuple)):
        return sum(_nbytes(value) for value in sample)
    return 8  # a number (collated into one tensor element) or an object passed through


@contextlib.contextmanager
def _random_state_kept() -> Iterator[None]:
    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(python)
    np.random.set_state(numpy)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _size_flag(need: int) -> str:
    """Twice the need, in whole GiB (the main process holds batches too, and pinned copies)."""
    return f"{max(1, math.ceil(2 * need / GIB))}g"
