"""``data.decode=gpu``'s worker side: an image folder's JPEG files read as bytes and a plan.

:class:`JpegFiles` reads each file's bytes and JPEG header and draws the training crop with the
CPU path's code and random numbers; any other file is decoded here as on the CPU path. The
device stage (:class:`~trainkit.data.device.gpu_decode.JpegDecoder`) decodes the batch.
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from trainkit.data.batches import BadFile, Encoded, EncodedBatch, ImageBatch, Plan
from trainkit.data.sources.image_files import ImageFiles
from trainkit.data.transforms import (
    RandomResizedCropFlip,
    UnreadableImage,
    crop_box,
    decode_image,
)

_ORIENTATION = 0x0112  # the EXIF tag
_TRANSPOSED = (5, 6, 7, 8)  # orientations that swap height and width


def jpeg_plan(data: bytes, transform: Any) -> Plan | None:
    """The :class:`Plan` of a baseline RGB/grayscale JPEG (drawing the training crop and flip
    as ``transform`` would); None for any other file, which the CPU path decodes."""
    if data[:3] != b"\xff\xd8\xff":
        return None
    try:
        with Image.open(io.BytesIO(data)) as pil:  # the header only: no pixels decoded
            if pil.format != "JPEG" or pil.mode not in ("RGB", "L") or pil.info.get(
                    "progressive") or pil.info.get("progression"):
                return None
            width, height = pil.size
            orientation = int(pil.getexif().get(_ORIENTATION, 1))
    except Exception:  # Pillow raises many types: the CPU path says what is wrong
        return None
    if orientation not in range(1, 9):
        orientation = 1
    if orientation in _TRANSPOSED:
        height, width = width, height
    if not isinstance(transform, RandomResizedCropFlip):
        return Plan(height, width, orientation, None, False)
    # RandomResizedCropFlip.__call__'s draws, in its order
    box = crop_box(height, width, scale=transform.scale, ratio=transform.ratio)
    flip = transform.flip and random.random() < 0.5
    return Plan(height, width, orientation, box, flip)


class JpegFiles(ImageFiles):
    """:class:`~trainkit.data.sources.image_files.ImageFiles` whose JPEG samples are
    :class:`Encoded` (bytes and plan), every other file decoded and transformed here as the CPU
    path does.
    ``transform`` is :class:`RandomResizedCropFlip` (training) or :class:`ResizeCenterCrop`."""

    def _load(self, path: str) -> Encoded | torch.Tensor:
        """A JPEG's bytes and plan; any other file decoded and transformed (the skip and
        bad-file handling around it is :class:`ImageFiles`'s)."""
        try:
            data = Path(path).read_bytes()
        except OSError as err:
            raise UnreadableImage(f"cannot read image file {path}: {err}") from None
        plan = jpeg_plan(data, self.transform)
        if plan is not None:
            return Encoded(torch.frombuffer(bytearray(data), dtype=torch.uint8), plan, path)
        image = decode_image(data, channels=self.channels, name=path)
        return self.transform(image) if self.transform is not None else image


def collate_encoded(samples: list[Any]) -> ImageBatch:
    """:class:`JpegFiles` samples as an :class:`ImageBatch` whose images are an
    :class:`EncodedBatch`; bad files travel as they are (the main process reports them)."""
    bad = [s for s in samples if isinstance(s, BadFile)]
    if bad:
        return ImageBatch(None, torch.empty(0, dtype=torch.int64), [], bad)
    labels = torch.tensor([s[1] for s in samples], dtype=torch.int64)
    return ImageBatch(EncodedBatch([s[0] for s in samples]), labels,
                      [p for s in samples for p in s[2]], [])
