"""The device stage: each batch checked, copied to the device ahead of use, decoded, normalised.

On CUDA, while the model computes on batch ``i`` the prefetcher has already queued the copy
(and decoding, and normalisation) of batch ``i+1`` on its own stream; the compute stream waits
for that stream only when it takes the batch. Elsewhere it copies and normalises in line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from trainkit.core.device import move_to_device
from trainkit.core.errors import TrainkitError
from trainkit.core.tree import tensors
from trainkit.data.classes import STATE_KEY, check_same_classes
from trainkit.data.loader.resumable import ResumableData, set_epoch
from trainkit.data.transforms import Normalize

log = logging.getLogger("trainkit")


class DevicePrefetcher:
    """Wraps a loader; yields its batches on ``device``, the first tensor normalised there.

    Batches are ``(inputs, ...)`` tuples or lists, or a batch of image files (``images``,
    ``labels``, and the files ``skipped`` or ``bad``): a bad file stops the run here, in the
    main process, with one line; a skipped one (``data.skip_corrupt``) is counted and logged
    once. uint8 inputs are cast and scaled to 0-1 on the device (a quarter of the bytes over
    PCIe), then ``(x - mean) / std`` when ``mean`` and ``std`` are given. Pin the loader's
    memory (``make_loader`` does on CUDA) or the copies cannot overlap.

    It holds no position, nor does the loader: the caller asks for ``batches(epoch, start)``
    (the Trainer, from its state); ``len``, ``set_epoch`` and the loader's settings pass
    through. Its state keeps the class names (a resume on other classes is refused) and the
    files skipped so far.

    Args:
        loader: any iterable of batches.
        device: where the batches go.
        mean, std: per-channel statistics on the 0-1 scale; None skips normalisation.
        channels_last: make 4-D inputs NHWC-strided on the device.
        normalize_float: also normalise float inputs with ``mean``/``std``; False takes them
            as they are (transforms that normalised already).
        classes: class names by index, kept in :meth:`state_dict` (None: none known).
        decoder: ``data.decode=gpu``'s :class:`~trainkit.data.device.gpu_decode.JpegDecoder`,
            which decodes each batch on the device before normalisation.

    Example:
        >>> loader = DevicePrefetcher(make_loader(ds, 256, shuffle=True, device="cuda"),
        ...                           "cuda", mean=(0.49, 0.48, 0.45), std=(0.25, 0.24, 0.26))
        ... # doctest: +SKIP
    """

    def __init__(self, loader: Iterable[Any], device: torch.device | str, *,
                 mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
                 channels_last: bool = False, normalize_float: bool = True,
                 classes: Sequence[str] | None = None, decoder: Any = None) -> None:
        if (mean is None) != (std is None):
            raise ValueError("give both mean and std, or neither")
        self.loader, self.device = loader, torch.device(device)
        self.channels_last, self.normalize_float = channels_last, normalize_float
        self.classes = list(classes) if classes is not None else None
        self.decoder = decoder
        self.skipped: set[str] = set()
        self._mean = self._std = None
        self._normalize: Normalize | None = None
        if mean is not None and std is not None:
            # every constant on the device once, here: built per batch, each would be a copy
            # from pageable host memory that the host waits for
            self._normalize = Normalize(mean, std, self.device)
            self._mean = torch.tensor(mean).view(1, -1, 1, 1).to(self.device)
            self._std = torch.tensor(std).view(1, -1, 1, 1).to(self.device)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @property
    def dataset(self) -> Any:
        return getattr(self.loader, "dataset", None)

    @property
    def batch_size(self) -> int | None:
        return getattr(self.loader, "batch_size", None)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Forward the resume protocol to the wrapped loader."""
        set_epoch(self.loader, epoch, start_batch)

    def state_dict(self) -> dict[str, Any]:
        """The loader's settings, the class names, and the files skipped so far (sorted)."""
        state: dict[str, Any] = {}
        if isinstance(self.loader, ResumableData):
            state = dict(self.loader.state_dict())
        if self.classes is not None:
            state[STATE_KEY] = self.classes
        if self.skipped:
            state["skipped_files"] = sorted(self.skipped)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Check :meth:`state_dict`'s classes and settings; count its skipped files on."""
        self.resume_check(state)
        if isinstance(self.loader, ResumableData):
            self.loader.load_state_dict(state)

    def resume_check(self, saved: Mapping[str, Any]) -> None:
        """A checkpoint's loader state against this loader: the same classes (else one line),
        and the files it skipped are counted on. The checkpointer calls this on resume."""
        if self.classes is not None:
            check_same_classes(saved.get(STATE_KEY), self.classes)
        self.skipped.update(saved.get("skipped_files", ()))

    def report(self) -> dict[str, Any]:
        """What ``summary.json`` says of the data: ``data/skipped_files`` (this rank's)."""
        return {"data/skipped_files": len(self.skipped)}

    def note_skipped(self, paths: Sequence[str]) -> None:
        """Count files a batch skipped; each new one is logged once."""
        for path in paths:
            if path not in self.skipped:
                self.skipped.add(path)
                log.warning("skipped unreadable file %s (data.skip_corrupt=true; %d so far)",
                            path, len(self.skipped))

    def __iter__(self) -> Iterator[Any]:
        return self._on_device(self.loader)

    def batches(self, epoch: int, start: int = 0) -> Iterator[Any]:
        """The batches ``start, ...`` of ``epoch`` on the device, for a caller that holds the
        position (the look-ahead stays inside this pass: nothing to subtract)."""
        source = getattr(self.loader, "batches", None)
        if source is None:  # a loader of another kind: pointed there, then iterated
            set_epoch(self.loader, epoch, start)
            return self._on_device(self.loader)
        return self._on_device(source(epoch, start))

    def _on_device(self, loader: Iterable[Any]) -> Iterator[Any]:
        """``loader``'s batches on the device (on CUDA the next one copied ahead)."""
        if self._stream is None:
            for batch in loader:
                yield self._prepare(self._placed(batch))
            return
        yield from self._iter_cuda(self._stream, loader)

    def _iter_cuda(self, stream: torch.cuda.Stream, loader: Iterable[Any]) -> Iterator[Any]:
        batches = iter(loader)
        upcoming = self._preload(batches, stream)
        while upcoming is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(stream)  # the copy and normalisation are done before use
            for tensor in tensors(upcoming):
                # Allocated on the side stream, used on this one: without this the caching
                # allocator could hand the memory to the next copy while compute still reads it.
                tensor.record_stream(current)
            batch, upcoming = upcoming, self._preload(batches, stream)
            yield batch

    def _preload(self, batches: Iterator[Any], stream: torch.cuda.Stream) -> Any:
        try:
            batch = next(batches)
        except StopIteration:
            return None
        with torch.cuda.stream(stream):
            # non_blocking copies from pinned memory: this returns before the bytes arrive
            return self._prepare(self._placed(batch))

    def _placed(self, batch: Any) -> Any:
        """``batch`` on the device. A batch of image files becomes ``(images, labels)``: a bad
        file stops the run here, in the main process, with one line; skipped ones are counted;
        its tensors are copied here. Any other batch is copied as a tree (``move_to_device``).
        """
        if not (hasattr(batch, "images") and hasattr(batch, "labels")):
            return move_to_device(batch, self.device)
        if getattr(batch, "bad", None):
            raise TrainkitError(batch.bad[0].message)
        self.note_skipped(getattr(batch, "skipped", ()))
        return self._copy(batch.images), self._copy(batch.labels)

    def _copy(self, x: Any) -> Any:
        """One tensor to the device, asynchronously from pinned memory (where the copy can
        overlap compute); the encoded JPEGs of ``data.decode=gpu`` go to their decoder as
        they are."""
        if not isinstance(x, torch.Tensor):
            return move_to_device(x, self.device)
        if x.device == self.device:
            return x
        return x.to(self.device, non_blocking=self.device.type == "cuda" and x.is_pinned())

    def _prepare(self, batch: Any) -> Any:
        if self.decoder is not None:
            batch = self.decoder(batch[0], batch[1], self.note_skipped)
        if not isinstance(batch, (tuple, list)) or not batch:
            return batch
        x = batch[0]
        if isinstance(x, torch.Tensor) and x.dtype == torch.uint8:
            layout = torch.channels_last if self.channels_last and x.dim() == 4 else (
                torch.contiguous_format)
            x = (self._normalize(x, memory_format=layout) if self._normalize is not None
                 else x.float().div_(255))
        elif isinstance(x, torch.Tensor) and self._mean is not None and self.normalize_float:
            x = (x - self._mean) / self._std
        if self.channels_last and isinstance(x, torch.Tensor) and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return type(batch)([x, *batch[1:]]) if isinstance(batch, list) else (x, *batch[1:])

