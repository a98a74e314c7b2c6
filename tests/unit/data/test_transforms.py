"""Image decoding and transforms: every file kind to RGB or luma, torchvision's crop distribution,
timm's evaluation crop, normalisation in one pass."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import RandomResizedCrop, v2

from tests.image_files import KINDS, picture, save, truncate
from trainkit.data.transforms import (
    UnreadableImage,
    crop_box,
    decode_image,
    eval_transform,
    load_image,
    normalize,
    train_transform,
)


@pytest.mark.parametrize("kind", KINDS, ids=[f"{k[0]}-{k[1]}" for k in KINDS])
def test_every_kind_decodes_to_rgb_and_luma(tmp_path: Path, kind: tuple) -> None:
    array = picture(np.random.default_rng(0), 1, 30, 40)
    path = save(array, tmp_path / "image", kind)
    rgb, gray = load_image(path), load_image(path, channels=1)
    shape = (40, 30) if kind[1] == "EXIF" else (30, 40)  # orientation 6: turned a quarter
    assert rgb.dtype == gray.dtype == torch.uint8
    assert rgb.shape == (3, *shape) and gray.shape == (1, *shape)
    if kind[1] in ("L", "I;16"):
        assert torch.equal(rgb[0], rgb[1]) and torch.equal(rgb[1], rgb[2])
    if kind[1] in ("RGB", "RGBA", "EXIF") and kind[0] in ("png", "bmp"):
        assert torch.equal(rgb, torch.from_numpy(array).permute(2, 0, 1))  # lossless: exact
    if kind[1] == "I;16":  # 16-bit: the top byte, not clipped to 255
        expected = np.array(Image.fromarray(array).convert("L"))
        assert torch.equal(gray[0], torch.from_numpy(expected))
    if kind[1] == "EXIF":  # shown as a viewer shows it: turned 90 degrees clockwise
        stored = torch.from_numpy(array).permute(2, 0, 1).int()
        gap = lambda turn: (rgb.int() - stored.rot90(turn, (1, 2))).abs().float().mean()  # noqa: E731
        assert gap(-1) < gap(1) / 2  # JPEG's loss only, not another turn


def test_truncated_and_foreign_files_raise_naming_the_file(tmp_path: Path) -> None:
    jpeg = truncate(save(picture(np.random.default_rng(0), 0, 64, 64), tmp_path / "cut",
                         KINDS[0]))
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    for path in (jpeg, text):
        with pytest.raises(UnreadableImage, match=str(path)) as caught:
            decode_image(path.read_bytes(), name=str(path))
        assert "\n" not in str(caught.value) and "skip_corrupt" in str(caught.value)


def _ks(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the two CDFs."""
    grid = np.sort(np.concatenate([a, b]))
    cdf = lambda x: np.searchsorted(np.sort(x), grid, side="right") / len(x)  # noqa: E731
    return float(np.abs(cdf(a) - cdf(b)).max())


@pytest.mark.parametrize(("height", "width"), [(375, 500), (120, 480)])
def test_crops_follow_torchvisions_random_resized_crop(height: int, width: int) -> None:
    n, scale, ratio = 4000, (0.08, 1.0), (3 / 4, 4 / 3)
    random.seed(0)
    ours = np.array([crop_box(height, width, scale=scale, ratio=ratio) for _ in range(n)])
    torch.manual_seed(0)
    image = torch.zeros(1, height, width)
    theirs = np.array([RandomResizedCrop.get_params(image, list(scale), list(ratio))
                       for _ in range(n)])
    limit = 1.95 * math.sqrt(2 / n)  # KS critical value, significance 0.001
    for a, b in ((ours, theirs),):
        assert _ks(a[:, 2] * a[:, 3] / (height * width), b[:, 2] * b[:, 3] / (height * width)
                   ) < limit  # area fraction
        assert _ks(np.log(a[:, 3] / a[:, 2]), np.log(b[:, 3] / b[:, 2])) < limit  # aspect
        assert _ks(a[:, 0] / height, b[:, 0] / height) < limit  # where: top
        assert _ks(a[:, 1] / width, b[:, 1] / width) < limit  # and left
    assert (ours[:, 0] + ours[:, 2] <= height).all() and (ours[:, 1] + ours[:, 3] <= width).all()


def test_train_transform_crops_resizes_and_flips() -> None:
    image = torch.arange(3 * 50 * 80, dtype=torch.int32).remainder(256).to(torch.uint8)
    image = image.view(3, 50, 80)
    random.seed(1)
    out = train_transform(24, scale=(1.0, 1.0), ratio=(1.6, 1.6), flip=False)(image)
    assert out.shape == (3, 24, 24) and out.dtype == torch.uint8
    # the whole image (scale 1, its own aspect ratio): a plain antialiased resize of it
    assert torch.equal(out, v2.functional.resize(image, [24, 24], antialias=True))
    flips = {bool(torch.equal(train_transform(24, scale=(1.0, 1.0), ratio=(1.6, 1.6))(image),
                              out.flip(-1))) for _ in range(20)}
    assert flips == {True, False}


def test_eval_transform_is_timms_resize_and_centre_crop() -> None:
    image = torch.randint(0, 256, (3, 375, 500), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(0))
    timm = v2.Compose([v2.Resize(math.floor(224 / 0.875), antialias=True), v2.CenterCrop(224)])
    ours = eval_transform(224, crop_pct=0.875)(image)
    assert ours.shape == (3, 224, 224)
    assert (ours.int() - timm(image).int()).abs().max() <= 1  # the memory layout's rounding


def test_normalize_is_the_usual_formula_in_the_layout_asked() -> None:
    x = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    expected = (x.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(
        std).view(1, 3, 1, 1)
    for layout in (torch.contiguous_format, torch.channels_last):
        got = normalize(x.contiguous(memory_format=torch.channels_last), mean, std,
                        memory_format=layout)
        assert got.is_contiguous(memory_format=layout) and got.dtype == torch.float32
        assert torch.allclose(got, expected, atol=1e-5)


def test_auto_augment_and_random_erasing_follow_the_seeded_generators() -> None:
    from trainkit.data.transforms import train_transform

    image = torch.randint(0, 256, (3, 40, 50), dtype=torch.uint8)
    plain = train_transform(24)
    for policy in ("randaugment", "trivialaugment"):
        augmented = train_transform(24, auto_augment=policy, random_erasing=0.5)
        outs = []
        for _ in range(2):
            random.seed(3)
            torch.manual_seed(3)
            outs.append(augmented(image))
        assert torch.equal(outs[0], outs[1]) and outs[0].dtype == torch.uint8
        random.seed(3)
        assert outs[0].shape == plain(image).shape == (3, 24, 24)
    erase = train_transform(24, random_erasing=1.0, fill=(0.5, 0.25, 0.0))
    out = erase(torch.full((3, 40, 50), 255, dtype=torch.uint8))
    erased = (out != 255).all(0)
    assert erased.any()
    assert out[:, erased].unique(dim=1).tolist() == [[128], [64], [0]]  # the fill colour


def test_auto_augment_with_own_transforms_is_refused() -> None:
    from trainkit.config import ImageFolderConfig
    from trainkit.core.errors import ConfigError
    from trainkit.data.transforms import transform_for

    cfg = ImageFolderConfig(auto_augment="randaugment")
    with pytest.raises(ConfigError, match=r"data\.train_transforms"):
        transform_for(cfg, training=True, custom=[lambda x: x])
    transform_for(cfg, training=False, custom=[lambda x: x])  # evaluation: not augmented
