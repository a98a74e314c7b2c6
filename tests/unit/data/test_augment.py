"""Batch augmentation on the device: the same result as per-image pad-crop-flip, reproducibly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.unit.data.test_data import _data
from trainkit.data import InMemoryLoader, crop_flip, mix_seed
from trainkit.data.sources.tensors import TensorData


def _reference(images: torch.Tensor, seed: int, padding: int, flip: bool, mode: str
               ) -> torch.Tensor:
    """Per image, the torchvision way: pad, crop at the drawn offset, maybe flip."""
    g = torch.Generator().manual_seed(seed)
    shifts = torch.randint(-padding, padding + 1, (2, len(images)), generator=g)
    flips = torch.randint(0, 2 if flip else 1, (len(images),), generator=g)
    h, w = images.shape[-2:]
    out = []
    for i, image in enumerate(images.float()):
        padded = F.pad(image[None], (padding,) * 4, mode=mode)[0]
        dy, dx = shifts[0, i] + padding, shifts[1, i] + padding
        crop = padded[:, dy : dy + h, dx : dx + w]
        out.append(crop.flip(-1) if flips[i] else crop)
    return torch.stack(out)


@pytest.mark.parametrize("mode", ["constant", "reflect"])
@pytest.mark.parametrize(("padding", "flip"), [(4, True), (2, False), (0, True)])
def test_matches_per_image_pad_crop_flip(mode: str, padding: int, flip: bool) -> None:
    images = torch.randint(0, 256, (64, 3, 12, 10), dtype=torch.uint8)
    got = crop_flip(images, torch.Generator().manual_seed(5), padding=padding, flip=flip,
                    pad_mode=mode)
    assert got.shape == images.shape and got.dtype == torch.uint8
    assert torch.equal(got.float(), _reference(images, 5, padding, flip, mode))


def test_statistics_of_flips_and_shifts() -> None:
    n, p = 4000, 3
    # every image is a ramp 0..w-1 along the width: the first pixel reveals shift and flip
    images = torch.arange(1, 17, dtype=torch.uint8).expand(n, 1, 16, 16).contiguous()
    out = crop_flip(images, torch.Generator().manual_seed(0), padding=p, flip=True,
                    pad_mode="reflect")
    row = out[:, 0, 8].long()
    flipped = row[:, 0] > row[:, -1]
    assert 0.45 < flipped.float().mean() < 0.55
    # the pixel at the middle column tells the shift: uniform over -p..p
    shift = torch.where(flipped, 16 - row[:, 8] - 8, row[:, 8] - 9)
    counts = torch.bincount(shift + p, minlength=2 * p + 1)
    assert len(counts) == 2 * p + 1 and counts.min() > n / (2 * p + 1) * 0.8
    # translation moves pixels but keeps the batch's value range
    assert out.min() >= 1 and out.max() <= 16


def test_constant_padding_uncovers_zeros_reflect_does_not() -> None:
    images = torch.full((500, 1, 8, 8), 7, dtype=torch.uint8)
    g = torch.Generator
    constant = crop_flip(images, g().manual_seed(1), padding=2, pad_mode="constant")
    reflect = crop_flip(images, g().manual_seed(1), padding=2, pad_mode="reflect")
    zero_share = (constant == 0).float().mean()
    assert 0.1 < zero_share < 0.5  # E[uncovered] = 1 - (1 - 1.2/8)^2 ~ 0.28
    assert (reflect == 7).all()


def test_mix_seed_separates_nearby_keys() -> None:
    seeds = {mix_seed(0, e, b, 0) for e in range(20) for b in range(50)}
    assert len(seeds) == 1000 and all(0 <= s < 2**63 for s in seeds)


def _augmenting(data: TensorData, **kw: object) -> InMemoryLoader:
    return InMemoryLoader(data, 8, shuffle=True, seed=3, padding=2, flip=True, **kw)


def _images(n: int = 64) -> TensorData:
    images = torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    return TensorData(images, torch.arange(n), (0.5,) * 3, (0.25,) * 3, num_classes=10)


def test_resumed_loader_reproduces_the_augmented_batches() -> None:
    loader = _augmenting(_images())
    loader.set_epoch(1)
    full = [x for x, _ in loader]
    other = _augmenting(_images())  # a fresh process after a restart
    other.set_epoch(1, start_batch=5)
    rest = [x for x, _ in other]
    assert len(rest) == len(full) - 5
    assert all(torch.equal(a, b) for a, b in zip(rest, full[5:]))
    loader.set_epoch(2)
    assert not torch.equal(next(iter(loader))[0], full[0])  # a new epoch, new draws


def test_augmentation_is_on_and_eval_unchanged() -> None:
    data = _images()
    plain = InMemoryLoader(data, 64, shuffle=False)
    aug = InMemoryLoader(data, 64, shuffle=False, padding=2, flip=True)
    x, _ = next(iter(plain))
    y, _ = next(iter(aug))
    assert x.shape == y.shape and not torch.equal(x, y)
    assert torch.allclose(x, (data.images.float() - 0.5 * 255) / (0.25 * 255))


def test_loader_state_dict_round_trip() -> None:
    loader = _augmenting(_images())
    loader.set_epoch(4)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    assert state == {"seed": 3}  # the settings a resume must match; the caller holds the position
    expected = next(it)[0]
    fresh = _augmenting(_images())
    fresh.load_state_dict(state)
    assert torch.equal(next(fresh.batches(4, 3))[0], expected)


def test_bad_settings_are_one_line_errors() -> None:
    from trainkit.core.errors import ConfigError

    with pytest.raises(ConfigError, match="pad_mode"):
        InMemoryLoader(_data(), 8, shuffle=True, pad_mode="wrap")
    with pytest.raises(ConfigError, match="drop_last"):
        InMemoryLoader(_data(10), 16, shuffle=True, drop_last=True)
    with pytest.raises(ConfigError, match="rank 3"):
        InMemoryLoader(_data(), 8, shuffle=True, rank=3, world_size=2)


def test_data_config_checks_augmentation_ranges() -> None:
    from trainkit.config import DataConfig
    from trainkit.core.errors import ConfigError

    assert DataConfig(random_crop_padding=4, pad_mode="reflect").random_crop_padding == 4
    with pytest.raises(ConfigError, match=r"data\.random_crop_padding"):
        DataConfig(random_crop_padding=-1)
    with pytest.raises(ConfigError, match=r"data\.pad_mode"):
        DataConfig(pad_mode="edge")


@pytest.mark.parametrize("mode", ["constant", "reflect"])
def test_gpu_gather_path_equals_cpu_unfold_path(mode: str) -> None:
    # the CUDA path (one gather) runs on CPU tensors too: check it against the CPU path
    from trainkit.data.loader.augment import _by_gather, _by_unfold

    g = torch.Generator().manual_seed(2)
    images = torch.randint(0, 256, (50, 3, 9, 11), dtype=torch.uint8, generator=g)
    shifts = torch.randint(-3, 4, (2, 50), generator=g)
    flips = torch.randint(0, 2, (50,), generator=g).bool()
    assert torch.equal(_by_gather(images, shifts, flips, 3, mode),
                       _by_unfold(images, shifts, flips, 3, mode))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_draws_on_the_gpu_match_per_image_pad_crop_flip_there() -> None:
    """A CUDA generator draws on the GPU (no host copy a batch); the batch is the per-image
    reference of the same draws, and the memory loader on CUDA uses such a generator."""
    images = torch.randint(0, 256, (64, 3, 12, 10), dtype=torch.uint8)
    g = torch.Generator("cuda").manual_seed(5)
    shifts = torch.randint(-4, 5, (2, 64), generator=g, device="cuda")
    flips = torch.randint(0, 2, (64,), generator=g, device="cuda").bool()
    got = crop_flip(images.cuda(), torch.Generator("cuda").manual_seed(5), padding=4, flip=True)
    from trainkit.data.loader.augment import _by_unfold

    assert torch.equal(got.cpu(), _by_unfold(images, shifts.cpu(), flips.cpu(), 4, "constant"))
