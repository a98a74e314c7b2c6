"""Image folders for tests: every format and mode a user's folder may hold, small and fast."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image

# One of each kind a folder of photos and scans holds: format, Pillow mode, save options.
KINDS = [
    ("jpg", "RGB", {"quality": 90}),
    ("png", "RGB", {}),
    ("webp", "RGB", {"quality": 80}),
    ("bmp", "RGB", {}),
    ("png", "L", {}),
    ("png", "P", {}),
    ("png", "RGBA", {}),
    ("jpg", "CMYK", {"quality": 90}),
    ("png", "I;16", {}),
    ("jpg", "L", {"quality": 90}),
    ("jpg", "EXIF", {"quality": 90}),  # rotated by its EXIF orientation tag
    ("png", "Pt", {}),  # a palette with a transparent entry
]


def picture(rng: np.random.Generator, label: int, height: int, width: int) -> np.ndarray:
    """A smooth RGB picture whose colour says its class (a net learns it in a few steps)."""
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    base = np.array([(label * 97) % 256, (label * 57 + 80) % 256, (label * 151 + 30) % 256])
    ramp = (np.sin(6 * x + rng.uniform(0, 6)) + np.cos(5 * y)) * 25
    image = base[None, None, :] + ramp[..., None] + rng.normal(0, 8, (height, width, 3))
    return image.clip(0, 255).astype(np.uint8)


def save(array: np.ndarray, path: Path, kind: tuple[str, str, dict]) -> Path:
    """Save ``array`` (RGB, uint8) as ``kind``; the path gets the kind's suffix."""
    suffix, mode, options = kind
    image = Image.fromarray(array)
    path = path.with_suffix(f".{suffix}")
    if mode == "EXIF":
        exif = image.getexif()
        exif[0x0112] = 6  # stored rotated: shown turned 90 degrees clockwise
        image.save(path, exif=exif, **options)
        return path
    if mode == "I;16":
        gray = np.asarray(image.convert("L"), dtype=np.uint16) * 257
        Image.fromarray(gray).save(path)
        return path
    if mode == "Pt":
        image.convert("P").save(path, transparency=0)
        return path
    image.convert(mode).save(path, **options)
    return path


def make_folder(root: Path, *, classes: int = 3, per_class: int = 8, val_per_class: int = 4,
                seed: int = 0, sizes: tuple[int, int] = (40, 72)) -> Path:
    """``root/train/<class>/`` and ``root/val/<class>/`` of mixed sizes, formats and modes."""
    rng = np.random.default_rng(seed)
    n = 0
    for split, count in (("train", per_class), ("val", val_per_class)):
        for label in range(classes):
            folder = root / split / f"class_{label}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                h, w = rng.integers(sizes[0], sizes[1], size=2)
                save(picture(rng, label, int(h), int(w)), folder / f"img{i:03d}",
                     KINDS[n % len(KINDS)])
                n += 1
    return root


def make_digits(root: Path, digits: Sequence[int], *, per_class: int, val_per_class: int,
                rotate: int = 0, seed: int = 0, size: int = 32) -> Path:
    """``root/{train,val}/digit_<d>/`` of digits drawn with Pillow's font, each at its own
    size, place and tilt, turned ``rotate`` degrees: one set to pretrain on, its rotations to
    fine-tune on (a real transfer: the strokes are the same)."""
    from PIL import ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    for split, count in (("train", per_class), ("val", val_per_class)):
        for digit in digits:
            folder = root / split / f"digit_{digit}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                image = Image.new("L", (size, size))
                font = ImageFont.load_default(size=int(rng.integers(size * 5 // 8, size * 7 // 8)))
                at = (size // 2 + int(rng.integers(-3, 4)), size // 2 + int(rng.integers(-3, 4)))
                ImageDraw.Draw(image).text(at, str(digit), fill=255, font=font, anchor="mm")
                image = image.rotate(rotate + float(rng.uniform(-12, 12)))
                noisy = np.asarray(image, dtype=np.float64) + rng.normal(0, 20, (size, size))
                Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(folder / f"{i:03d}.png")
    return root


def truncate(path: Path, keep: float = 0.5) -> Path:
    """Cut the file to ``keep`` of its bytes (a download that broke off)."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


class TinyNet(torch.nn.Module):
    """A small conv net for image-folder runs of a few steps (any image size, 1 or 3 channels)."""

    def __init__(self, num_classes: int, channels: int = 3, width: int = 8) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(channels, width, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
        self.head = torch.nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class Pictures(torch.utils.data.Dataset):
    """A torch Dataset as users write them for other projects: PIL images of mixed sizes and
    their labels (``classes`` names them), from files it lists itself."""

    def __init__(self, root: str, train: bool = True) -> None:
        from torchvision.datasets import ImageFolder

        self.folder = ImageFolder(str(Path(root) / ("train" if train else "val")))
        self.classes = self.folder.classes

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        return self.folder[index]


def hf_split(root: str, train: bool = True, **kwargs: object) -> object:
    """A Hugging Face ``datasets.Dataset`` from local files (``imagefolder``); ``kwargs`` go to
    ``load_dataset`` (``cache_dir``)."""
    from trainkit.data.sources.dataset import load_split

    return load_split(root, train, path="imagefolder", eval_split="validation", **kwargs)
