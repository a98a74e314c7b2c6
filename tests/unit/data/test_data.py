from __future__ import annotations

import pytest
import torch

from trainkit.config import DataConfig
from trainkit.core.errors import ConfigError
from trainkit.core.runtime import Runtime
from trainkit.data import InMemoryLoader, build_loaders
from trainkit.data.sources.tensors import TensorData


def _data(n: int = 100) -> TensorData:
    images = torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, 1, 2, 2).contiguous()
    return TensorData(images, torch.arange(n), mean=(0.5,), std=(0.25,), num_classes=10)


def _labels(loader: InMemoryLoader) -> list[int]:
    return torch.cat([y for _, y in loader]).tolist()


def test_order_is_a_function_of_seed_and_epoch() -> None:
    a = InMemoryLoader(_data(), 16, shuffle=True, seed=1)
    b = InMemoryLoader(_data(), 16, shuffle=True, seed=1)
    a.set_epoch(3)
    b.set_epoch(3)
    assert _labels(a) == _labels(b)
    b.set_epoch(4)
    assert _labels(a) != _labels(b)
    assert sorted(_labels(b)) == list(range(100))


def test_resuming_mid_epoch_yields_exactly_the_rest() -> None:
    loader = InMemoryLoader(_data(), 16, shuffle=True, seed=7)
    loader.set_epoch(2)
    full = [y.tolist() for _, y in loader]
    loader.set_epoch(2, start_batch=4)
    assert [y.tolist() for _, y in loader] == full[4:]
    # the offset applies to one pass; the next pass of the same epoch is whole again
    assert [y.tolist() for _, y in loader] == full


def test_batches_are_normalised_floats() -> None:
    loader = InMemoryLoader(_data(), 10, shuffle=False)
    x, y = next(iter(loader))
    expected = (y.float().view(-1, 1, 1, 1) - 0.5 * 255) / (0.25 * 255)
    assert x.dtype == torch.float32
    assert torch.allclose(x, expected.expand_as(x))


def test_len_and_last_partial_batch() -> None:
    loader = InMemoryLoader(_data(100), 32, shuffle=True)
    assert len(loader) == 4
    assert [len(y) for _, y in loader] == [32, 32, 32, 4]
    dropping = InMemoryLoader(_data(100), 32, shuffle=True, drop_last=True)
    assert len(dropping) == 3 and [len(y) for _, y in dropping] == [32, 32, 32]


def test_training_shards_are_disjoint_and_equal_sized() -> None:
    shards = [InMemoryLoader(_data(101), 8, shuffle=True, seed=3, rank=r, world_size=3)
              for r in range(3)]
    labels = [set(_labels(s)) for s in shards]
    assert all(len(s) == 101 // 3 for s in labels)  # cut to a multiple: same steps per rank
    assert not (labels[0] & labels[1]) and not (labels[1] & labels[2])


def test_evaluation_shards_cover_every_sample_once() -> None:
    shards = [InMemoryLoader(_data(101), 8, shuffle=False, rank=r, world_size=3)
              for r in range(3)]
    seen = sorted(label for s in shards for label in _labels(s))
    assert seen == list(range(101))


def test_channels_last_batches() -> None:
    data = TensorData(torch.zeros(4, 3, 5, 5, dtype=torch.uint8), torch.zeros(4, dtype=torch.long),
                      mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), num_classes=2)
    x, _ = next(iter(InMemoryLoader(data, 4, shuffle=False, channels_last=True)))
    assert x.is_contiguous(memory_format=torch.channels_last)


def test_build_loaders_serves_a_dataset_of_ones_own() -> None:
    calls = []

    def reader(root: str, train: bool) -> TensorData:
        calls.append((root, train))
        return _data(100 if train else 40)

    cfg = DataConfig(name="mine", root="/somewhere", batch_size=10, eval_batch_size=20)
    train, test, num_classes = build_loaders(cfg, Runtime.from_env("cpu"), reader=reader)
    assert calls == [("/somewhere", True), ("/somewhere", False)]
    assert (len(train), len(test), num_classes) == (10, 2, 10)


def test_an_unknown_dataset_name_points_to_dataset_target() -> None:
    with pytest.raises(ConfigError,
                       match=r"not one of mnist, cifar10, image_folder, tokens, webdataset, "
                             r"hf_text, npy_folder; .*dataset\._target_"):
        build_loaders(DataConfig(name="imagenet"), Runtime.from_env("cpu"))
