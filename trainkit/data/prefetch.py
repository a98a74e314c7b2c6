"""Overlap host-to-device copies with compute: the next batch travels on a side CUDA stream.

On CUDA, while the model computes on batch ``i`` the prefetcher has already queued the copy (and
normalisation) of batch ``i+1`` on its own stream; the compute stream waits for that stream only
when it takes the batch. Elsewhere it is a pass-through that still normalises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from trainkit.core.device import move_to_device
from trainkit.core.tree import tensors
from trainkit.data.resumable import DataPosition, PositionedLoader, set_epoch
from trainkit.data.transforms import Normalize


class DevicePrefetcher(PositionedLoader):
    """Wraps a loader; yields its batches on ``device``, the first tensor normalised there.

    Batches are ``(inputs, ...)`` tuples or lists. Inputs that arrive as uint8 (0-255) are cast
    to float32 and scaled to 0-1 on the device (a quarter of the bytes over PCIe), then
    ``(x - mean) / std`` when ``mean`` and ``std`` are given. Pin the loader's memory
    (``make_loader`` does on CUDA) or the copies cannot overlap.

    ``len``, ``set_epoch(epoch, start_batch)``, ``batch_size``, ``state_dict`` and
    ``load_state_dict`` pass through, so the Trainer treats it as the loader itself.

    Args:
        loader: any iterable of batches.
        device: where the batches go.
        mean, std: per-channel statistics on the 0-1 scale; None skips normalisation.
        channels_last: make 4-D inputs NHWC-strided on the device.
        normalize_float: also normalise float inputs with ``mean``/``std``; False takes them
            as they are (transforms that normalised already).
        finish: called on each batch once on the device, before normalisation (on the side
            stream on CUDA): ``data.decode=gpu``'s decoding.

    Example:
        >>> loader = DevicePrefetcher(make_loader(ds, 256, shuffle=True, device="cuda"),
        ...                           "cuda", mean=(0.49, 0.48, 0.45), std=(0.25, 0.24, 0.26))
        ... # doctest: +SKIP
    """

    def __init__(self, loader: Iterable[Any], device: torch.device | str, *,
                 mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
                 channels_last: bool = False, normalize_float: bool = True,
                 finish: Callable[[Any], Any] | None = None) -> None:
        if (mean is None) != (std is None):
            raise ValueError("give both mean and std, or neither")
        self.loader = loader
        self.device = torch.device(device)
        self.channels_last = channels_last
        self.normalize_float = normalize_float
        self.finish = finish
        self._mean = self._std = None
        self._normalize: Normalize | None = None
        if mean is not None and std is not None:
            # every constant on the device once, here: built per batch, each would be a copy
            # from pageable host memory that the host waits for
            self._normalize = Normalize(mean, std, self.device)
            self._mean = torch.tensor(mean).view(1, -1, 1, 1).to(self.device)
            self._std = torch.tensor(std).view(1, -1, 1, 1).to(self.device)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.position = DataPosition()

    @property
    def batch_size(self) -> int | None:
        return getattr(self.loader, "batch_size", None)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Forward the resume protocol to the wrapped loader."""
        super().set_epoch(epoch, start_batch)
        set_epoch(self.loader, epoch, start_batch)

    def __iter__(self) -> Iterator[Any]:
        self.position.begin_pass()
        if self._stream is None:
            for batch in self.loader:
                self.position.batch += 1
                yield self._prepare(move_to_device(batch, self.device))
            return
        yield from self._iter_cuda(self._stream)

    def _iter_cuda(self, stream: torch.cuda.Stream) -> Iterator[Any]:
        batches = iter(self.loader)
        upcoming = self._preload(batches, stream)
        while upcoming is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(stream)  # the copy and normalisation are done before use
            for tensor in tensors(upcoming):
                # Allocated on the side stream, used on this one: without this the caching
                # allocator could hand the memory to the next copy while compute still reads it.
                tensor.record_stream(current)
            batch, upcoming = upcoming, self._preload(batches, stream)
            self.position.batch += 1
            yield batch

    def _preload(self, batches: Iterator[Any], stream: torch.cuda.Stream) -> Any:
        try:
            batch = next(batches)
        except StopIteration:
            return None
        with torch.cuda.stream(stream):
            # non_blocking copies from pinned memory: this returns before the bytes arrive
            return self._prepare(move_to_device(batch, self.device))

    def _prepare(self, batch: Any) -> Any:
        if self.finish is not None:
            batch = self.finish(batch)
        if not isinstance(batch, (tuple, list)) or not batch:
            return batch
        x = batch[0]
        if isinstance(x, torch.Tensor) and x.dtype == torch.uint8:
            # one multiply-add after the cast (trainkit.data.transforms.normalize)
            layout = torch.channels_last if self.channels_last and x.dim() == 4 else (
                torch.contiguous_format)
            x = (self._normalize(x, memory_format=layout) if self._normalize is not None
                 else x.float().div_(255))
        elif isinstance(x, torch.Tensor) and self._mean is not None and self.normalize_float:
            x = (x - self._mean) / self._std
        if self.channels_last and isinstance(x, torch.Tensor) and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return type(batch)([x, *batch[1:]]) if isinstance(batch, list) else (x, *batch[1:])

