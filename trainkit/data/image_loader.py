"""The loader of an image dataset: workers decode and crop, the device normalises.

:class:`ImageLoader` is what the Trainer gets for ``data=image_folder`` (and any dataset of
files): a :func:`~trainkit.data.make_loader` DataLoader (resumable, sharded, seeded per batch,
pinned on CUDA) whose uint8 batches a :class:`~trainkit.data.DevicePrefetcher` copies to the
device and normalises there. In the main process it checks each batch for files that could not
be decoded: one line naming the file stops the run, or with ``skip_corrupt`` the file is counted
(``data/skipped_files`` in ``summary.json``) and logged once. Its ``state_dict`` also holds the
class names (saved in every checkpoint; a resume on other classes is refused).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from trainkit.core.errors import TrainkitError
from trainkit.data.classes import STATE_KEY, check_same_classes
from trainkit.data.image_folder import ImageBatch
from trainkit.data.loaders import ResumableLoader
from trainkit.data.prefetch import DevicePrefetcher
from trainkit.data.resumable import MappedBatches, saved_position

log = logging.getLogger("trainkit")


class ImageLoader:
    """Batches of images on the device, normalised; the resume protocol of any trainkit loader.

    Args:
        loader: a :class:`~trainkit.data.ResumableLoader` over an
            :class:`~trainkit.data.image_folder.ImageFiles` (collated by
            :func:`~trainkit.data.image_folder.collate_images`) or any dataset.
        device: where batches go.
        mean, std: per-channel statistics (0-1 scale) for uint8 images; float images (from
            your own transforms) are taken as they are.
        classes: class names by index, kept in :meth:`state_dict` (None: none known).
        channels_last: NHWC-strided images on the device.
        decoder: ``data.decode=gpu``'s :class:`~trainkit.data.gpu_decode.JpegDecoder`, which
            finishes each batch of JPEG bytes on the device before normalisation.
    """

    def __init__(self, loader: ResumableLoader, device: torch.device | str, *,
                 mean: Sequence[float] | None, std: Sequence[float] | None,
                 classes: Sequence[str] | None = None, channels_last: bool = False,
                 decoder: Any = None) -> None:
        self.loader = loader
        self.classes = list(classes) if classes is not None else None
        self.skipped: set[str] = set()
        self.decoder = decoder
        self.prefetcher = DevicePrefetcher(
            MappedBatches(loader, self.checked), device, mean=mean, std=std,
            channels_last=channels_last, normalize_float=False,
            finish=self._decode if decoder is not None else None)

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def batch_size(self) -> int:
        return self.loader.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.prefetcher)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Serve ``epoch`` from batch ``start_batch`` on; the batches before are never loaded."""
        self.prefetcher.set_epoch(epoch, start_batch)

    def state_dict(self) -> dict[str, Any]:
        """The position, the class names, and the files skipped so far (sorted)."""
        state: dict[str, Any] = self.prefetcher.state_dict()
        if self.classes is not None:
            state[STATE_KEY] = self.classes
        if self.skipped:
            state["skipped_files"] = sorted(self.skipped)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s position (and its count of skipped files)."""
        self.resume_check(state)
        self.set_epoch(*saved_position(state))

    def resume_check(self, saved: Mapping[str, Any]) -> None:
        """A checkpoint's loader state against this loader: the same classes (else one line),
        and the files it skipped are counted on. The checkpointer calls this on resume."""
        if self.classes is not None:
            check_same_classes(saved.get(STATE_KEY), self.classes)
        self.skipped.update(saved.get("skipped_files", ()))

    def _decode(self, batch: tuple[Any, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decoder(batch[0], batch[1], self.note_skipped)

    def checked(self, batch: Any) -> Any:
        """A DataLoader's :class:`ImageBatch` as ``(images, labels)``: a bad file stops the run
        here, in the main process, with one line; skipped ones are counted."""
        if not isinstance(batch, ImageBatch):
            return batch
        if batch.bad:
            raise TrainkitError(batch.bad[0].message)
        self.note_skipped(batch.skipped)
        return batch.images, batch.labels

    def note_skipped(self, paths: Sequence[str]) -> None:
        """Count files a batch skipped; each new one is logged once."""
        for path in paths:
            if path not in self.skipped:
                self.skipped.add(path)
                log.warning("skipped unreadable file %s (data.skip_corrupt=true; %d so far)",
                            path, len(self.skipped))

    def report(self) -> dict[str, Any]:
        """What ``summary.json`` says of the data: ``data/skipped_files`` (this rank's)."""
        return {"data/skipped_files": len(self.skipped)}
