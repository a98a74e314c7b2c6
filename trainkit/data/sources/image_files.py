"""Image files as a map-style dataset: decoded and transformed in the loader's workers.

:class:`ImageFiles` reads a list of files (paths kept in a :class:`PathTable`); an unreadable
one comes back as a :class:`~trainkit.data.batches.BadFile` (the main process fails or counts
it), or with ``skip_corrupt`` the next readable file's sample. :func:`collate_images` stacks
samples into an :class:`~trainkit.data.batches.ImageBatch`. The image folder and your own
``Dataset`` both serve their images through these.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from trainkit.data.batches import BadFile, ImageBatch
from trainkit.data.transforms import UnreadableImage, load_image

Transform = Callable[[torch.Tensor], Any]


class PathTable:
    """File paths as one byte buffer and offsets: loader workers read them without touching
    Python objects' reference counts, so their copy-on-write pages stay shared (a list of a
    million ``str`` grows every worker by its size; pytorch/pytorch#13246)."""

    def __init__(self, paths: Sequence[str]) -> None:
        encoded = [os.fsencode(p) for p in paths]
        self._offsets = np.cumsum([0] + [len(b) for b in encoded], dtype=np.int64)
        self._bytes = np.frombuffer(b"".join(encoded), dtype=np.uint8)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> str:
        return os.fsdecode(self._bytes[self._offsets[i]:self._offsets[i + 1]].tobytes())


class ImageFiles(Dataset):
    """One split as ``(uint8 image [C, H, W] after ``transform``, label)`` samples.

    Args:
        files: image paths.
        labels: their class indices.
        transform: applied to the decoded uint8 tensor (:mod:`trainkit.data.transforms`).
        channels: 3 (RGB) or 1 (grayscale).
        skip_corrupt: an unreadable file's sample is the next readable file's (the epoch keeps
            its length and order), and the sample carries the skipped path; else the sample is
            a :class:`BadFile`.
    """

    def __init__(self, files: Sequence[str], labels: Sequence[int], transform: Transform | None,
                 *, channels: int = 3, skip_corrupt: bool = False) -> None:
        self.paths = PathTable(files)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.transform, self.channels, self.skip_corrupt = transform, channels, skip_corrupt

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[Any, int, list[str]] | BadFile:
        skipped: list[str] = []
        for step in range(len(self)):
            i = (index + step) % len(self)
            path = self.paths[i]
            try:
                image = self._load(path)
            except UnreadableImage as err:
                if not self.skip_corrupt:
                    return BadFile(path, str(err))
                skipped.append(path)
                continue
            return image, int(self.labels[i]), skipped
        return BadFile(self.paths[index], "no file of this split can be decoded")

    def _load(self, path: str) -> Any:
        """One file decoded and transformed (raises :class:`UnreadableImage`)."""
        image = load_image(path, channels=self.channels)
        return self.transform(image) if self.transform is not None else image


def collate_images(samples: list[Any]) -> ImageBatch:
    """Stack :class:`ImageFiles` samples; bad ones travel as they are, to fail in the main
    process (``default_collate`` puts the images in shared memory inside a worker).

    uint8 images stay uint8: a quarter of float32's bytes through shared memory and the pinned
    copy, and one copy fewer than normalising here (the
    :class:`~trainkit.data.DevicePrefetcher` normalises where the batch lands, on any device).
    """
    bad = [s for s in samples if isinstance(s, BadFile)]
    if bad:
        return ImageBatch(None, torch.empty(0, dtype=torch.int64), [], bad)
    first = samples[0][0]
    if isinstance(first, torch.Tensor) and first.dim() == 3 and first.stride(0) == 1:
        # channels-last images (decoders' and the transforms' layout): stacked as [B, H, W, C],
        # one plain copy each, viewed as [B, C, H, W] (normalize writes the layout asked for)
        images = default_collate([s[0].permute(1, 2, 0) for s in samples]).permute(0, 3, 1, 2)
    else:
        images = default_collate([s[0] for s in samples])
    labels = torch.tensor([s[1] for s in samples], dtype=torch.int64)
    return ImageBatch(images, labels, [p for s in samples for p in s[2]], [])
