"""The types a batch takes on its way, in one place: every stage imports them, none owns them.

* :class:`TensorData` -- a whole split held as uint8 tensors (a source's, or your reader's);
* :class:`BadFile` -- a sample a worker could not load, carried to the main process to fail
  (or be counted) there;
* :class:`ImageBatch` -- a collated batch of image files: images, labels, skipped and bad files;
* :class:`Encoded`, :class:`EncodedBatch`, :class:`Plan` -- JPEGs read by a worker, decoded by
  the device stage (``data.decode=gpu``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


@dataclass(frozen=True)
class TensorData:
    """A whole split in memory: ``images`` uint8 ``[N, C, H, W]``, ``labels`` int64 ``[N]``."""

    images: torch.Tensor
    labels: torch.Tensor
    mean: tuple[float, ...]
    std: tuple[float, ...]
    num_classes: int

    def __len__(self) -> int:
        return len(self.labels)


class BadFile(NamedTuple):
    """A sample that could not be loaded: its file and why."""

    path: str
    message: str


class ImageBatch(NamedTuple):
    """A collated batch: images, labels, the files skipped for it, and any file that failed."""

    images: Any
    labels: torch.Tensor
    skipped: list[str]
    bad: list[BadFile]


class Plan(NamedTuple):
    """What the device does to one decoded JPEG: its header's (oriented) size, the EXIF
    orientation, the crop ``(top, left, h, w)`` in oriented coordinates (None: evaluation's
    resize and centre crop), and whether to flip."""

    height: int
    width: int
    orientation: int
    box: tuple[int, int, int, int] | None
    flip: bool


class Encoded:
    """A JPEG sample from a worker: its bytes (uint8, 1-D), its :class:`Plan`, its path.

    A plain class, not a tuple or dataclass: the prefetcher's device move leaves it whole (the
    bytes go to the decoder from host memory)."""

    def __init__(self, data: torch.Tensor, plan: Plan, path: str) -> None:
        self.data, self.plan, self.path = data, plan, path


class EncodedBatch:
    """A collated batch: the JPEGs' bytes in one tensor with their spans, and by position
    either a JPEG's index or an already finished image (decoded in the worker)."""

    def __init__(self, samples: Sequence[Encoded | torch.Tensor]) -> None:
        jpegs = [s for s in samples if isinstance(s, Encoded)]
        self.data = torch.cat([s.data for s in jpegs]) if jpegs else torch.empty(
            0, dtype=torch.uint8)
        ends = list(itertools.accumulate(len(s.data) for s in jpegs))
        self.spans = list(zip([0, *ends[:-1]], ends))
        self.plans = [s.plan for s in jpegs]
        self.paths = [s.path for s in jpegs]
        self.items = [s if isinstance(s, torch.Tensor) else None for s in samples]

    def pin_memory(self) -> EncodedBatch:
        """The DataLoader's pinning (on CUDA): the finished images pinned, so their copy to the
        device does not block the host; the bytes stay (nvJPEG reads them on the host)."""
        self.items = [s.pin_memory() if s is not None else None for s in self.items]
        return self
