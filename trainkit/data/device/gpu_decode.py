"""``data.decode=gpu``: an image folder's JPEGs decoded on the GPU, a batch in one nvJPEG call.

Workers (:class:`~trainkit.data.sources.jpeg_files.JpegFiles`) read each file's bytes and
JPEG header and draw the training crop with the CPU path's code and random numbers; other
files (PNG, CMYK or progressive JPEG, ...) are decoded in the worker as on the CPU path. On
the device (:class:`JpegDecoder`, called by the :class:`~trainkit.data.DevicePrefetcher`
before normalising): one ``decode_jpeg`` call per batch, then per image the EXIF orientation
(nvJPEG ignores it), the crop, the CPU path's resize and flip (or ``ResizeCenterCrop``). A
JPEG nvJPEG refuses is decoded on the CPU instead; an out-of-memory or device error is raised,
never hidden by that fallback (:func:`fatal`). On the CPU the pixels equal the CPU path's; on
CUDA they may differ by a grey level or two (nvJPEG's IDCT and upsampling, a float resize).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from typing import Any

import torch

from trainkit.config import SharedDataConfig
from trainkit.core.errors import ConfigError, TrainkitError
from trainkit.data.batches import EncodedBatch, Plan
from trainkit.data.transforms import UnreadableImage, decode_image, resize

log = logging.getLogger("trainkit")



def orient(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """A ``[C, H, W]`` image as its EXIF ``orientation`` (1-8) says to show it (as Pillow's
    ``exif_transpose`` and torchvision's ``apply_exif_orientation`` do)."""
    if orientation == 2:
        return image.flip(-1)
    if orientation == 3:
        return image.flip(-2, -1)
    if orientation == 4:
        return image.flip(-2)
    if orientation == 5:
        return image.transpose(-2, -1)
    if orientation == 6:
        return image.rot90(-1, (-2, -1))
    if orientation == 7:
        return image.transpose(-2, -1).flip(-2, -1)
    if orientation == 8:
        return image.rot90(1, (-2, -1))
    return image


Decode = Callable[..., Any]  # torchvision.io.decode_jpeg's signature (the tests' seam)
# Not a file's fault: raised, never answered by decoding one by one or on the CPU. torch 2.11
# (the floor) may lack AcceleratorError; torchvision wraps errors in "Error while decoding JPEG
# images: <what>", hence the messages.
_FATAL_TYPES = tuple(t for t in (torch.OutOfMemoryError, getattr(torch, "AcceleratorError", None))
                     if t is not None)
_FATAL_MESSAGES = ("out of memory", "not compiled with nvjpeg", "cuda error",
                   "failed to synchronize cuda stream")


def fatal(err: BaseException) -> bool:
    """True for an error of the device or the build (out of memory, a CUDA error, no nvJPEG),
    which no fallback may hide; False for a file the decoder refuses."""
    return isinstance(err, _FATAL_TYPES) or any(m in str(err).lower() for m in _FATAL_MESSAGES)


class StreamOrder:
    """Orders ``decode_jpeg`` on CUDA against the stream that uses its images.

    torchvision (``decode_jpegs_cuda.cpp``) allocates the images on the caller's current
    stream, writes them on a stream of its own pool after waiting for that stream only (not the
    caller's), then makes the current stream wait for it. On the prefetcher's stream a block
    freed by the previous batch, its resize still queued, could be handed to the decoder and
    overwritten. So the images are allocated on a stream of ours that runs nothing else (its
    blocks are reused only once the uses recorded here are done), the using stream waits for
    it, and each image records that use. No host wait is added.

    ``stream``, ``current`` and ``context`` default to torch.cuda's (a test passes fakes).
    """

    def __init__(self, device: torch.device, *, stream: Any = None,
                 current: Callable[[], Any] | None = None,
                 context: Callable[[Any], Any] | None = None) -> None:
        self.stream = stream if stream is not None else torch.cuda.Stream(device)
        self.current = current or (lambda: torch.cuda.current_stream(device))
        self.context = context or torch.cuda.stream

    def decode(self, decode: Decode, data: Any, **kwargs: Any) -> Any:
        """``decode(data, **kwargs)`` with its outputs ordered before their use here."""
        user = self.current()
        with self.context(self.stream):
            images = decode(data, **kwargs)
        user.wait_stream(self.stream)
        for image in images if isinstance(images, list) else [images]:
            image.record_stream(user)
        return images


def probe_nvjpeg(device: torch.device | str, decode: Decode | None = None) -> str:
    """Decode one small JPEG on ``device``, once at the start: the line to log.

    Raises:
        ConfigError: the decoder fails (no nvJPEG in this torchvision, a device error).
    """
    from PIL import Image

    if decode is None:
        from torchvision.io import decode_jpeg as decode
    buffer = io.BytesIO()
    Image.new("RGB", (16, 8), (200, 30, 90)).save(buffer, "JPEG")
    data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    try:
        shape = tuple(decode([data], device=torch.device(device))[0].shape)
    except Exception as err:  # any failure: the run must not start on this path
        raise ConfigError(f"data.decode=gpu: torchvision cannot decode JPEGs on {device} "
                          f"({' '.join(str(err).split())[:160]}): use data.decode=cpu") from None
    if shape != (3, 8, 16):
        raise ConfigError(f"data.decode=gpu: a 16x8 JPEG decoded on {device} as {shape}: use "
                          "data.decode=cpu")
    import torchvision

    return (f"data.decode=gpu: torchvision {torchvision.__version__} decodes JPEGs on {device}"
            f"{' (nvJPEG)' if torch.device(device).type == 'cuda' else ''}")


class JpegDecoder:
    """Finishes :class:`EncodedBatch` es on ``device``: a uint8 ``[B, C, S, S]`` batch.

    Args:
        device: where to decode (``cuda``; ``cpu`` runs the same steps through libjpeg-turbo).
        channels: 3 (RGB) or 1 (grayscale: nvJPEG decodes the luma only).
        transform: the split's :class:`RandomResizedCropFlip` or :class:`ResizeCenterCrop`.
        skip_corrupt: a JPEG neither decoder reads is replaced by another image of the batch
            (with its label) and reported to ``on_skip``; else one line naming it is raised.
        decode: ``torchvision.io.decode_jpeg`` unless given (the tests' seam).
        order: how decoding is ordered against this stream (:class:`StreamOrder` on CUDA).
    """

    def __init__(self, device: torch.device | str, *, channels: int, transform: Any,
                 skip_corrupt: bool = False, decode: Decode | None = None,
                 order: StreamOrder | None = None) -> None:
        from torchvision.io import ImageReadMode, decode_jpeg  # heavy import: on this path only

        self.device = torch.device(device)
        self.decode = decode or decode_jpeg
        self.order = order or (StreamOrder(self.device) if self.device.type == "cuda" else None)
        self.mode = ImageReadMode.RGB if channels == 3 else ImageReadMode.GRAY
        self.channels = channels
        self.transform, self.skip_corrupt = transform, skip_corrupt
        self.rejected: list[str] = []  # the current batch's unreadable JPEGs (skip_corrupt)

    def __call__(self, batch: EncodedBatch, labels: torch.Tensor,
                 on_skip: Callable[[list[str]], None] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's images (and labels: changed only where a bad JPEG was replaced)."""
        self.rejected = []
        jpegs = iter(self._decode([batch.data[a:b] for a, b in batch.spans], batch.plans,
                                  batch.paths))
        images: list[torch.Tensor | None] = []
        for item in batch.items:
            images.append(item.to(self.device, non_blocking=True) if item is not None
                          else next(jpegs))
        bad = [i for i, image in enumerate(images) if image is None]
        if bad:
            good = next((i for i, image in enumerate(images) if image is not None), None)
            if good is None:
                raise TrainkitError(f"no image of a batch can be decoded: replace or delete "
                                    f"such files, e.g. {self.rejected[0]}")
            labels = labels.clone()
            for i in bad:  # the batch keeps its size (and the epoch its length)
                images[i], labels[i] = images[good], labels[good]
            if on_skip is not None:
                on_skip(self.rejected)
        return torch.stack(images), labels  # type: ignore[arg-type]

    def _decode(self, data: list[torch.Tensor], plans: list[Plan],
                paths: list[str]) -> list[torch.Tensor | None]:
        if not data:
            return []
        try:
            decoded = self._on_device(data)
        except RuntimeError as err:  # one file fails the whole call: find it, one by one
            if fatal(err):
                raise
            return [self._one(d, plan, path) for d, plan, path in zip(data, plans, paths)]
        return [self._finish(image, plan, path)
                for image, plan, path in zip(decoded, plans, paths)]

    def _on_device(self, data: list[torch.Tensor]) -> list[torch.Tensor]:
        """The decode function on the device, ordered against this stream on CUDA."""
        if self.order is None:
            return self.decode(data, mode=self.mode, device=self.device)
        return self.order.decode(self.decode, data, mode=self.mode, device=self.device)

    def _one(self, data: torch.Tensor, plan: Plan, path: str) -> torch.Tensor | None:
        """One JPEG; one the device's decoder refuses goes to the CPU path's decoder (a variant
        nvJPEG lacks decodes there; a corrupt file is named as the CPU path names it)."""
        try:
            return self._finish(self._on_device([data])[0], plan, path)
        except RuntimeError as err:
            if fatal(err):
                raise
        try:
            image = decode_image(data.numpy().tobytes(), channels=self.channels, name=path)
        except UnreadableImage as err:
            return self._reject(path, str(err))
        # decode_image applied the EXIF orientation already
        return self._finish(image.to(self.device), plan._replace(orientation=1), path)

    def _reject(self, path: str, message: str) -> None:
        if not self.skip_corrupt:
            raise UnreadableImage(message)
        self.rejected.append(path)

    def _finish(self, image: torch.Tensor, plan: Plan, path: str) -> torch.Tensor | None:
        image = orient(image, plan.orientation)
        if tuple(image.shape[-2:]) != (plan.height, plan.width):
            return self._reject(path, f"an image file decodes to another size than its header "
                                      f"says; replace or delete it, or set "
                                      f"data.skip_corrupt=true to skip such files: {path}")
        if plan.box is None:
            return self.transform(image)  # ResizeCenterCrop: the CPU path's own code
        top, left, h, w = plan.box
        size = self.transform.size
        out = resize(image[..., top:top + h, left:left + w], (size, size))
        return out.flip(-1) if plan.flip else out


def check_gpu_decode(cfg: SharedDataConfig, device: torch.device | str, *, decodes_files: bool,
                     custom_transforms: bool) -> None:
    """``data.decode=gpu``'s preconditions, each a one-line :class:`ConfigError`; nvJPEG is
    tried once here (:func:`probe_nvjpeg`) and its line logged."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ConfigError(f"data.decode=gpu needs a CUDA device (this run's is {device}, CUDA "
                          f"{'available' if torch.cuda.is_available() else 'unavailable'}): "
                          "use data.decode=cpu")
    if not decodes_files:  # the source's answer (an image folder's; not your own dataset's)
        raise ConfigError(f"data.decode=gpu is for data=image_folder (data.name={cfg.name!r}): "
                          "use data.decode=cpu")
    if custom_transforms:
        raise ConfigError("data.decode=gpu applies the default transforms on the GPU, not "
                          "data.train_transforms/eval_transforms: drop them or use "
                          "data.decode=cpu")
    log.info(probe_nvjpeg(device))

