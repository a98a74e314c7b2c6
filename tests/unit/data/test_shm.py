"""DataLoader workers and /dev/shm: the batches in flight must fit (Docker's default is 64 MB)."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from trainkit.core.errors import ConfigError
from trainkit.data import make_loader
from trainkit.data.loader.shm import fit_shared_memory, plan_workers, shm_free_bytes

MiB = 2**20


def test_batches_that_fit_change_nothing() -> None:
    assert plan_workers(8 * MiB, 4, 2, free_bytes=64 * MiB) == (4, 2, None)
    assert plan_workers(8 * MiB, 4, 2, free_bytes=None) == (4, 2, None)  # no /dev/shm: no check


@pytest.mark.parametrize(("free_mib", "expected"), [
    (40, (4, 1)),  # 5 batches fit: prefetch goes first, all 4 workers stay
    (24, (3, 1)),  # 3 fit: then workers
    (8, (1, 1)),   # exactly one batch
])
def test_too_little_shm_lowers_prefetch_then_workers(free_mib: int,
                                                     expected: tuple[int, int]) -> None:
    workers, prefetch, warning = plan_workers(8 * MiB, 4, 2, free_bytes=free_mib * MiB)
    assert (workers, prefetch) == expected
    assert workers * prefetch * 8 <= free_mib
    assert "--shm-size=1g or --ipc=host" in warning and "4 workers x prefetch 2" in warning


def test_not_one_batch_fitting_stops_with_one_line_naming_the_fix() -> None:
    with pytest.raises(ConfigError) as err:
        plan_workers(200 * MiB, 8, 2, free_bytes=64 * MiB)
    message = str(err.value)
    assert "\n" not in message and len(message) <= 200, message
    # 8 x 2 x 200 MiB = 3.1 GiB in flight: twice that, rounded up to whole GiB
    assert "--shm-size=7g or --ipc=host" in message and "num_workers=0" in message


class RandomImages(Dataset):
    """3x64x64 float32 samples (48 KiB) drawn from the global generators, as random transforms
    draw."""

    def __len__(self) -> int:
        return 100

    def __getitem__(self, i: int) -> dict:
        return {"image": torch.rand(3, 64, 64), "label": random.randrange(10),
                "extra": np.zeros(4, dtype=np.float64)}


def test_the_batch_is_sized_from_a_sample_without_moving_the_random_streams(caplog) -> None:
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    expected = (torch.rand(1), random.random(), np.random.rand())
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    # batch 128 x (48 KiB + 8 + 32 bytes) ~ 6 MiB; 4 workers x prefetch 2 need ~48 MiB
    with caplog.at_level(logging.WARNING, logger="trainkit"):
        assert fit_shared_memory(RandomImages(), 128, 4, None, free_bytes=20 * MiB) == (3, 1)
    assert (torch.rand(1), random.random(), np.random.rand()) == expected
    assert "using 3 workers x prefetch 1" in caplog.text
    assert fit_shared_memory(RandomImages(), 128, 4, None, free_bytes=64 * MiB) == (4, None)
    assert fit_shared_memory(RandomImages(), 128, 0, None, free_bytes=1) == (0, None)


def test_make_loader_fits_its_workers_to_the_free_shm(monkeypatch) -> None:
    assert shm_free_bytes("/no/such/shm") is None
    # This machine's /dev/shm as a default Docker container would have it after other use
    monkeypatch.setattr("trainkit.data.loader.shm.shm_free_bytes", lambda: 20 * MiB)
    # 2 workers x prefetch 2 x 6 MiB: only 3 batches fit
    loader = make_loader(RandomImages(), 128, shuffle=True, num_workers=2)
    assert (loader.loader.num_workers, loader.loader.prefetch_factor) == (2, 1)
    loader = make_loader(RandomImages(), 16, shuffle=True, num_workers=2)  # 3 MiB: fits
    assert (loader.loader.num_workers, loader.loader.prefetch_factor) == (2, 2)
