"""Batch augmentation on the device: random translation (crop with padding) and horizontal flip.

One copy per batch does both (a gather on GPUs, a pick among unfolded views on CPUs), on uint8
images, wherever the batch lives. The random draws come from a generator seeded by
``(seed, epoch, batch, rank)``, so batch ``b`` of an epoch is the same augmented batch whether
the run got there directly or resumed there from a checkpoint. The draws are made on the
generator's device: a generator on the batch's GPU costs no copy from the host per batch (drawn
on the CPU, they would cross as a copy from pageable memory, which waits for the GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainkit.config import PAD_MODES


def crop_flip(
    images: torch.Tensor,
    generator: torch.Generator,
    *,
    padding: int = 0,
    flip: bool = False,
    pad_mode: str = "constant",
) -> torch.Tensor:
    """Randomly translate each image by up to ``padding`` pixels and flip half of them.

    The same as torchvision's ``RandomCrop(size, padding=padding, padding_mode=pad_mode)`` then
    ``RandomHorizontalFlip()`` per image, done for the whole batch at once.

    Args:
        images: ``[B, C, H, W]``, any dtype, on any device.
        generator: draws the shifts and flips (a few bytes per image) on its own device: best
            on the images' device (no copy from the host). A seed gives the same batch on every
            device of one type; CPU and CUDA generators draw different numbers.
        padding: largest shift in pixels; 0 turns translation off.
        flip: flip each image horizontally with probability 1/2.
        pad_mode: ``constant`` fills uncovered pixels with 0, ``reflect`` mirrors the image.

    Example:
        >>> x = torch.zeros(8, 3, 32, 32, dtype=torch.uint8)
        >>> crop_flip(x, torch.Generator().manual_seed(0), padding=4, flip=True).shape
        torch.Size([8, 3, 32, 32])
    """
    if pad_mode not in PAD_MODES:
        raise ValueError(f"pad_mode={pad_mode!r} is not one of {', '.join(PAD_MODES)}")
    b, _, h, w = images.shape
    if padding >= min(h, w) and pad_mode == "reflect":
        raise ValueError(f"reflect padding {padding} needs images larger than that, got {h}x{w}")
    on = generator.device
    shifts = torch.randint(-padding, padding + 1, (2, b), generator=generator, device=on)
    flips = torch.randint(0, 2 if flip else 1, (b,), generator=generator, device=on).bool()
    if padding == 0 and not flip:
        return images
    if images.device.type == "cpu":
        return _by_unfold(images, shifts, flips, padding, pad_mode)
    return _by_gather(images, shifts, flips, padding, pad_mode)


def _by_gather(images: torch.Tensor, shifts: torch.Tensor, flips: torch.Tensor, padding: int,
               pad_mode: str) -> torch.Tensor:
    """One advanced-indexing gather: a single kernel, the fast way on a GPU."""
    b, _, h, w = images.shape
    device = images.device
    shifts, flips = shifts.to(device), flips.to(device)  # no-ops when drawn there
    rows = torch.arange(h, device=device) + shifts[0, :, None]  # [B, H] source rows
    cols = torch.arange(w, device=device) + shifts[1, :, None]  # [B, W] source columns
    # Crop then flip: output column j reads padded column (shift + W-1-j).
    cols = torch.where(flips[:, None], cols.flip(1), cols)
    keep = None
    if pad_mode == "reflect":
        rows, cols = _reflect(rows, h), _reflect(cols, w)
    elif padding:
        keep = ((rows >= 0) & (rows < h))[:, :, None] & ((cols >= 0) & (cols < w))[:, None, :]
        rows, cols = rows.clamp(0, h - 1), cols.clamp(0, w - 1)
    batch = torch.arange(b, device=device)[:, None, None]
    # Advanced indices split by the channel slice: the result is [B, H, W, C]; permuting back
    # gives NCHW shape with channels-last strides, the layout fast convolutions want anyway.
    out = images[batch, :, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)
    if keep is not None:
        out = out * keep[:, None].to(out.dtype)
    return out


def _by_unfold(images: torch.Tensor, shifts: torch.Tensor, flips: torch.Tensor, padding: int,
               pad_mode: str) -> torch.Tensor:
    """Every crop of the padded batch is a view (two unfolds); one indexing copy takes each
    image's own. On a CPU this beats a gather of single pixels (an offset computed per element;
    benchmarks/README.md, data figures)."""
    b, _, h, w = images.shape
    p = padding
    if pad_mode == "constant":
        padded = F.pad(images, (p, p, p, p))
    else:
        padded = images.index_select(2, _reflect(torch.arange(-p, h + p), h))
        padded = padded.index_select(3, _reflect(torch.arange(-p, w + p), w))
    crops = padded.unfold(2, h, 1).unfold(3, w, 1)  # [B, C, 2p+1, 2p+1, H, W], no copy
    out = crops[torch.arange(b), :, shifts[0] + p, shifts[1] + p]
    ids = flips.nonzero().squeeze(1)
    if len(ids):
        out.index_copy_(0, ids, out.index_select(0, ids).flip(-1))
    return out


def _reflect(index: torch.Tensor, size: int) -> torch.Tensor:
    """Map indices in ``[-size+1, 2*size-2]`` into ``[0, size)`` by mirroring at the edges."""
    index = index.abs()
    return (size - 1) - ((size - 1) - index).abs()
