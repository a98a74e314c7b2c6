"""Images from files to training batches: decoding, the standard transforms, normalisation.

One implementation for every image path (``data=image_folder``, webdataset shards, prediction
and export), so training, evaluation and serving see the same pixels:

* :func:`decode_image` / :func:`load_image` -- file bytes to a uint8 ``[C, H, W]`` tensor, RGB
  (or one channel), EXIF orientation applied, whatever the file's mode; JPEGs through
  libjpeg-turbo (``torchvision.io.decode_jpeg``), everything else through Pillow.
* :func:`train_transform` -- torchvision's ``RandomResizedCrop`` distribution and a horizontal
  flip, on uint8 tensors (the crop is a view; one antialiased resize of the cropped pixels).
  Optionally torchvision's RandAugment / TrivialAugmentWide and RandomErasing after them.
* :func:`eval_transform` -- resize the short side to ``image_size / crop_pct``, centre crop.

Samples stay uint8 through workers, pinned memory and the copy; the device stage normalises
them, with :class:`Normalize` (defined here, beside the statistics it takes).
"""

from __future__ import annotations

import io
import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from trainkit.config import ImageFields
from trainkit.core.errors import ConfigError, TrainkitError, one_line

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# One channel: the mean of ImageNet's channel statistics (as timm does for grayscale models).
IMAGENET_GRAY_MEAN, IMAGENET_GRAY_STD = (0.449,), (0.226,)
# Pillow reads these; torchvision's ImageFolder's list, less the formats Pillow cannot decode.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp",
                  ".gif")
_JPEG_MAGIC = b"\xff\xd8\xff"

Transform = Callable[[torch.Tensor], torch.Tensor]


class UnreadableImage(TrainkitError):
    """A file that is not an image Pillow or libjpeg can decode (truncated, corrupt, other)."""


def default_stats(channels: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """ImageNet's per-channel mean and std (0-1 scale) for 3 channels, their average for 1."""
    return (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else (IMAGENET_GRAY_MEAN,
                                                                IMAGENET_GRAY_STD)


def load_image(path: str | Path, *, channels: int = 3) -> torch.Tensor:
    """The image file at ``path`` as a uint8 ``[channels, H, W]`` tensor (see :func:`decode_image`).

    Raises:
        UnreadableImage: the file cannot be read or decoded; the message names it.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise UnreadableImage(f"cannot read image file {path}: {one_line(err)}") from None
    return decode_image(data, channels=channels, name=str(path))


def decode_image(data: bytes | bytearray | memoryview, *, channels: int = 3,
                 name: str = "<bytes>") -> torch.Tensor:
    """Decode an image file's bytes to a uint8 ``[channels, H, W]`` tensor.

    ``channels=3`` gives RGB: grayscale is repeated, palette and CMYK converted, alpha dropped
    (as ``PIL.Image.convert("RGB")`` does, which is what torchvision's ImageFolder loads).
    ``channels=1`` gives luma (ITU-R 601-2). 16-bit images keep their top 8 bits. The EXIF
    orientation is applied. A truncated file is an error, never a half-grey image.

    Args:
        data: the whole file.
        channels: 3 (RGB) or 1 (grayscale).
        name: names the file in errors (its path).

    Raises:
        UnreadableImage: not an image, truncated, or corrupt.
    """
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3, got {channels}")
    if bytes(data[:3]) == _JPEG_MAGIC:
        image = _decode_jpeg(data, channels)
        if image is not None:
            return image
    try:
        with Image.open(io.BytesIO(data)) as pil:
            pil.load()  # a truncated file raises here (Pillow's LOAD_TRUNCATED_IMAGES is off)
            return pil_to_tensor(ImageOps.exif_transpose(pil), channels=channels)
    except Exception as err:  # Pillow raises many types for bad files
        why = ("not an image format Pillow reads" if isinstance(err, UnidentifiedImageError)
               else one_line(err, 60))
        # the path last: a shortened error line keeps its end
        raise UnreadableImage(f"cannot decode an image file ({why}); replace or delete it, or "
                              f"set data.skip_corrupt=true to skip such files: {name}") from None


def _decode_jpeg(data: bytes | bytearray | memoryview, channels: int) -> torch.Tensor | None:
    """libjpeg-turbo on the bytes; None for a JPEG it refuses (Pillow then decides)."""
    from torchvision.io import ImageReadMode, decode_jpeg  # heavy import: on first use only

    mode = ImageReadMode.RGB if channels == 3 else ImageReadMode.GRAY
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    try:
        return decode_jpeg(buffer, mode=mode, apply_exif_orientation=True)
    except RuntimeError:  # truncated, corrupt, or a variant it lacks: Pillow says which
        return None


def pil_to_tensor(image: Image.Image, *, channels: int = 3) -> torch.Tensor:
    """A PIL image of any mode as a uint8 ``[channels, H, W]`` tensor (RGB or luma)."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        # 16-bit: Pillow's convert("L") would clip to 255, not scale; keep the top byte.
        image = Image.fromarray((np.asarray(image, dtype=np.uint32) >> 8).clip(0, 255)
                                .astype(np.uint8))
    elif image.mode == "F":
        image = Image.fromarray(np.asarray(image).clip(0, 255).astype(np.uint8))
    elif image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")  # Pillow warns when a palette's alpha is dropped directly
    target = "RGB" if channels == 3 else "L"
    if image.mode != target:
        image = image.convert(target)
    array = torch.from_numpy(np.array(image, dtype=np.uint8))
    return array.unsqueeze(0) if channels == 1 else array.permute(2, 0, 1)


def crop_box(height: int, width: int, *, scale: Sequence[float] = (0.08, 1.0),
             ratio: Sequence[float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """A random crop ``(top, left, h, w)``: torchvision's ``RandomResizedCrop.get_params``.

    The same algorithm and distribution (area fraction uniform in ``scale``, log aspect ratio
    uniform in ``ratio``, ten tries, then the centre crop), drawn from Python's ``random``
    (the loader seeds it per batch) rather than from one-element torch tensors (several per
    image, each far dearer than a Python draw).
    """
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * random.uniform(scale[0], scale[1])
        aspect = math.exp(random.uniform(log_lo, log_hi))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return random.randint(0, height - h), random.randint(0, width - w), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        w, h = round(height * max(ratio)), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class RandomResizedCropFlip:
    """Training transform on a uint8 ``[C, H, W]`` tensor: :func:`crop_box`, antialiased
    bilinear resize of the crop to ``size x size``, then a flip with probability 1/2."""

    def __init__(self, size: int, *, scale: Sequence[float] = (0.08, 1.0),
                 ratio: Sequence[float] = (3 / 4, 4 / 3), flip: bool = True) -> None:
        self.size, self.scale, self.ratio, self.flip = size, tuple(scale), tuple(ratio), flip

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        top, left, h, w = crop_box(image.shape[-2], image.shape[-1], scale=self.scale,
                                   ratio=self.ratio)
        out = resize(image[..., top:top + h, left:left + w], (self.size, self.size))
        return out.flip(-1) if self.flip and random.random() < 0.5 else out

    def __repr__(self) -> str:
        return (f"RandomResizedCropFlip(size={self.size}, scale={self.scale}, "
                f"ratio={self.ratio}, flip={self.flip})")


class ResizeCenterCrop:
    """Evaluation transform (timm's): short side to ``floor(size / crop_pct)``, centre crop."""

    def __init__(self, size: int, *, crop_pct: float = 0.875) -> None:
        self.size, self.crop_pct = size, crop_pct
        self.resize_to = math.floor(size / crop_pct)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        h, w = image.shape[-2:]
        short = min(h, w)
        if short != self.resize_to:
            scale = self.resize_to / short
            # torchvision's Resize(int): the long side truncated, as int() does
            h, w = (self.resize_to, int(w * scale)) if h <= w else (int(h * scale),
                                                                     self.resize_to)
            image = resize(image, (h, w))
        top, left = round((h - self.size) / 2), round((w - self.size) / 2)
        if top < 0 or left < 0:  # crop_pct > 1: pad as torchvision's CenterCrop does
            from torchvision.transforms.v2.functional import center_crop
            return center_crop(image, [self.size, self.size])
        crop = image[..., top:top + self.size, left:left + self.size]
        return crop.permute(1, 2, 0).contiguous().permute(2, 0, 1)  # dense, channels-last

    def __repr__(self) -> str:
        return f"ResizeCenterCrop(size={self.size}, crop_pct={self.crop_pct})"


def resize(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Antialiased bilinear resize of a uint8 ``[C, H, W]`` tensor; stays uint8.

    The result is channels-last (``[H, W, C]`` in memory), as decoders give images: torch's
    uint8 resize is fastest there, and ``collate_images`` stacks such images with one copy
    each into a channels-last batch.
    """
    from torchvision.transforms.v2.functional import resize as tv_resize

    if image.dim() == 3 and image.shape[0] > 1:
        # a crop of a decoded image is an [H, W, C] window: one copy makes it dense
        image = image.permute(1, 2, 0).contiguous().permute(2, 0, 1)
    return tv_resize(image, list(size), antialias=True)


def train_transform(image_size: int = 224, *, scale: Sequence[float] = (0.08, 1.0),
                    ratio: Sequence[float] = (3 / 4, 4 / 3), flip: bool = True,
                    auto_augment: str | None = None, random_erasing: float = 0.0,
                    fill: Sequence[float] = IMAGENET_MEAN) -> Transform:
    """The default training transform: random-resized crop to ``image_size``, random flip;
    then, where asked, torchvision's ``RandAugment`` / ``TrivialAugmentWide``
    (``auto_augment``: ``randaugment`` / ``trivialaugment``) and ``RandomErasing`` with
    probability ``random_erasing``, erased to ``fill`` (0-1 scale: the mean, which normalises
    to 0, as torchvision's reference recipe erases after normalising).

    Takes and returns uint8 ``[C, H, W]`` tensors; draws from Python's ``random`` and torch's
    CPU generator (the loader seeds both per batch).

    Example:
        >>> t = train_transform(224)
        >>> t(torch.zeros(3, 375, 500, dtype=torch.uint8)).shape
        torch.Size([3, 224, 224])
    """
    crop = RandomResizedCropFlip(image_size, scale=scale, ratio=ratio, flip=flip)
    if auto_augment is None and not random_erasing:
        return crop
    from torchvision.transforms import v2

    steps: list[Callable[..., torch.Tensor]] = [crop]
    if auto_augment is not None:
        if auto_augment not in AUTO_AUGMENTS:
            raise ValueError(f"auto_augment={auto_augment!r}: use one of "
                             f"{', '.join(AUTO_AUGMENTS)}")
        # torchvision's ops run faster on a dense [C, H, W] image than on the crop's
        # channels-last one (collate_images stacks either layout)
        steps += [_contiguous, AUTO_AUGMENTS[auto_augment]()]
    if random_erasing:
        steps.append(v2.RandomErasing(p=random_erasing, value=[round(255 * v) for v in fill]))
    return v2.Compose(steps)


def _contiguous(image: torch.Tensor) -> torch.Tensor:
    return image.contiguous()


def _randaugment() -> Transform:
    from torchvision.transforms import v2

    return v2.RandAugment()


def _trivialaugment() -> Transform:
    from torchvision.transforms import v2

    return v2.TrivialAugmentWide()


# data.auto_augment's policies: torchvision's, with their default magnitudes
AUTO_AUGMENTS: dict[str, Callable[[], Transform]] = {"randaugment": _randaugment,
                                                      "trivialaugment": _trivialaugment}


def eval_transform(image_size: int = 224, *, crop_pct: float = 0.875) -> Transform:
    """The default evaluation transform: resize to ``image_size / crop_pct``, centre crop.

    Example:
        >>> eval_transform(224)(torch.zeros(3, 375, 500, dtype=torch.uint8)).shape
        torch.Size([3, 224, 224])
    """
    return ResizeCenterCrop(image_size, crop_pct=crop_pct)


def compose(transforms: Sequence[Callable[..., torch.Tensor]]) -> Transform:
    """Your own list of transforms (``data.train_transforms`` / ``data.eval_transforms``, built
    from ``_target_`` nodes by the entry point) as one, applied in order to the uint8 tensor."""
    from torchvision.transforms import v2

    return v2.Compose(list(transforms))


def transform_for(cfg: ImageFields, *, training: bool,
                  custom: Sequence[Callable[..., torch.Tensor]] | None = None) -> Transform:
    """The transform ``cfg`` describes for training or evaluation: ``custom`` (your
    ``data.train_transforms`` / ``data.eval_transforms``, already built) when given, else
    :func:`train_transform` (``image_size``, ``scale``, ``ratio``, ``random_flip``) or
    :func:`eval_transform` (``image_size``, ``crop_pct``)."""
    if custom:
        if training and (cfg.auto_augment or cfg.random_erasing):
            raise ConfigError("data.auto_augment and data.random_erasing extend the default "
                              "training transform: with data.train_transforms add torchvision's "
                              "v2.RandAugment / v2.RandomErasing to your list instead")
        return compose(custom)
    if training:
        return train_transform(cfg.image_size, scale=cfg.scale, ratio=cfg.ratio,
                               flip=cfg.random_flip, auto_augment=cfg.auto_augment,
                               random_erasing=cfg.random_erasing, fill=stats_for(cfg)[0])
    return eval_transform(cfg.image_size, crop_pct=cfg.crop_pct)


def stats_for(cfg: ImageFields) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(mean, std)`` of ``cfg`` (``data.mean`` / ``data.std``), ImageNet's where unset."""
    mean, std = default_stats(cfg.channels)
    return (tuple(cfg.mean) if cfg.mean is not None else mean,
            tuple(cfg.std) if cfg.std is not None else std)


def normalize(images: torch.Tensor, mean: Sequence[float], std: Sequence[float], *,
              memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
    """``(images / 255 - mean) / std`` as float32 for a uint8 ``[B, C, H, W]`` batch.

    Builds its constants on each call (on CUDA a blocking copy from host memory): for a loader's
    every batch use one :class:`Normalize`, which builds them once. Float input is returned as
    it is.
    """
    if images.dtype != torch.uint8:
        return images
    return Normalize(mean, std, images.device)(images, memory_format=memory_format)


class Normalize:
    """:func:`normalize` with its constants built once, on ``device``: no host sync per batch.

    One multiply-add, ``x * (1 / (255 std)) - mean / std``, written in ``memory_format`` whatever
    the batch's own layout: on a GPU one kernel reading uint8; on a CPU the cast into the output
    first (torch's vectorised copy; its mixed-dtype multiply-add is not, and is slower:
    benchmarks/README.md, data figures), then the multiply-add in place. The constants are made
    here, once (from host memory: on CUDA a copy the host waits for), never per batch.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float],
                 device: torch.device | str) -> None:
        self.mean, self.std, self.device = tuple(mean), tuple(std), torch.device(device)
        scale = torch.tensor([1 / (255 * s) for s in self.std], dtype=torch.float32)
        shift = torch.tensor([-m / s for m, s in zip(self.mean, self.std)], dtype=torch.float32)
        self.scale = scale.view(1, -1, 1, 1).to(self.device)
        self.shift = shift.view(1, -1, 1, 1).to(self.device)

    def __call__(self, images: torch.Tensor, *,
                 memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
        if images.dtype != torch.uint8:
            return images
        out = torch.empty(images.shape, dtype=torch.float32, device=images.device,
                          memory_format=memory_format)
        if images.device.type == "cpu":
            out.copy_(images)
            return torch.addcmul(self.shift, out, self.scale, out=out)
        return torch.addcmul(self.shift, images, self.scale, out=out)
