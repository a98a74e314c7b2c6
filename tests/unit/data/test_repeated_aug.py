"""Repeated augmentation (``data.repeated_aug``, timm's RepeatAugSampler): each sample's copies
spread over the ranks, augmented apart, in an epoch of the same length that resumes exactly."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.unit.data.test_loaders import NoisyRange
from trainkit.config import DataConfig, TensorDataConfig, WebDatasetConfig
from trainkit.core.errors import ConfigError
from trainkit.data import InMemoryLoader, TensorData, epoch_order, make_loader
from trainkit.data.sources import refuse_unread


@pytest.mark.parametrize("n", [24, 25])
def test_each_sample_has_its_copies_on_both_of_two_ranks(n: int) -> None:
    ranks = [epoch_order(n, seed=3, epoch=1, shuffle=True, rank=r, world_size=2, repeats=3)
             for r in range(2)]
    assert [len(r) for r in ranks] == [n // 2, n // 2]  # the epoch keeps its length
    counts = Counter(torch.cat(ranks).tolist())
    assert sorted(counts.values()) == [3] * 8  # 8 distinct samples, 3 copies each
    for index in counts:  # each sample is seen by both ranks (3 copies, 2 ranks)
        assert all(index in r.tolist() for r in ranks), index
    # the distinct samples are the epoch's permutation's first, and differ by epoch
    plain = epoch_order(n, seed=3, epoch=1, shuffle=True, world_size=1)
    assert set(counts) == set(plain[:8].tolist())
    other = epoch_order(n, seed=3, epoch=2, shuffle=True, rank=0, world_size=2, repeats=3)
    assert other.tolist() != ranks[0].tolist()


def test_one_repeat_is_the_plain_order() -> None:
    for rank in range(2):
        assert torch.equal(
            epoch_order(30, seed=5, epoch=4, shuffle=True, rank=rank, world_size=2, repeats=1),
            epoch_order(30, seed=5, epoch=4, shuffle=True, rank=rank, world_size=2))


def test_copies_are_augmented_apart_and_a_resume_is_bitwise_with_two_workers() -> None:
    # Two simulated ranks, 2 workers each: every copy's draw differs from its siblings', and a
    # pass started at batch 2 is the full pass's batches from 2 on, draws included.
    draws: dict[int, list[float]] = {}
    for rank in range(2):
        loader = make_loader(NoisyRange(24), 4, shuffle=True, seed=7, rank=rank, world_size=2,
                             num_workers=2, repeats=3)
        full = [(i.tolist(), r.tolist()) for i, r in loader.batches(1)]
        assert len(full) == len(loader) == 3  # 12 samples a rank, as without repeats
        assert [(i.tolist(), r.tolist()) for i, r in loader.batches(1, start=2)] == full[2:]
        for indices, values in full:
            for i, v in zip(indices, values, strict=True):
                draws.setdefault(i, []).append(v)
    assert sorted(len(v) for v in draws.values()) == [3] * 8
    assert all(len(set(v)) == 3 for v in draws.values()), draws


def test_in_memory_loader_repeats_on_the_device_path() -> None:
    data = TensorData(torch.arange(20, dtype=torch.uint8).view(20, 1, 1, 1).expand(20, 1, 4, 4)
                      .contiguous(), torch.arange(20), mean=(0.0,), std=(1.0,), num_classes=20)
    seen = []
    for rank in range(2):
        loader = InMemoryLoader(data, 5, shuffle=True, seed=1, rank=rank, world_size=2,
                                repeats=2)
        full = [y for _, y in loader.batches(0)]
        assert [y.tolist() for _, y in loader.batches(0, start=1)] == [y.tolist()
                                                                       for y in full[1:]]
        seen += torch.cat(full).tolist()
    assert len(seen) == 20 and sorted(Counter(seen).values()) == [2] * 10


def test_bad_values_and_kinds_without_it_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"data\.repeated_aug must be >= 1, got 0"):
        DataConfig(name="image_folder", repeated_aug=0)
    with pytest.raises(ConfigError, match=r"data\.repeated_aug must be an integer"):
        DataConfig(name="cifar10", repeated_aug=2.5)
    refuse_unread(DataConfig(name="cifar10", repeated_aug=3), TensorDataConfig, "cifar10")
    with pytest.raises(ConfigError, match=r"data\.repeated_aug=3 is not read by"):
        refuse_unread(DataConfig(name="webdataset", repeated_aug=3), WebDatasetConfig,
                      "webdataset")
    with pytest.raises(ConfigError, match="for training loaders"):
        make_loader(NoisyRange(8), 2, shuffle=False, num_workers=0, repeats=2)
