"""Loaders that feed the device from tensors held in memory: one gather per batch.

Each epoch's order is a pure function of ``(seed, epoch)`` and each batch's augmentation of
``(seed, epoch, batch, rank)``, so resuming at batch ``b`` costs nothing and reproduces exactly
the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from trainkit.core.errors import ConfigError
from trainkit.core.rng import mix_seed
from trainkit.data.batches import TensorData
from trainkit.data.loader.augment import PAD_MODES, crop_flip
from trainkit.data.loader.resumable import ResumableLoader, check_shard, epoch_order, shard_size


class InMemoryLoader(ResumableLoader):
    """Batches ``(images, labels)`` from a :class:`TensorData`, augmented and normalised on device.

    The uint8 data is moved to ``device`` once (GPU-resident on CUDA: no host copies per step);
    every batch is one index gather, an optional augmentation gather, a cast and normalisation
    there. The resumable loader's in-memory variant: its state also holds the seed.

    Args:
        data: the split to serve.
        batch_size: samples per batch on this rank.
        shuffle: a new order every epoch (training); ``False`` keeps file order (evaluation).
        drop_last: drop a last batch smaller than ``batch_size``.
        seed: with the epoch, fixes the order and the augmentation.
        device: where batches are produced.
        rank, world_size: each rank serves a disjoint shard. When shuffling, the epoch is cut to a
            multiple of ``world_size`` so every rank runs the same number of steps; evaluation
            keeps every sample exactly once.
        channels_last: produce NHWC-strided batches (faster convolutions on CPU and GPU).
        padding: random translation by up to this many pixels (random crop with padding); 0: off.
        flip: random horizontal flips.
        pad_mode: what translation uncovers: ``constant`` (zeros, like torchvision's RandomCrop)
            or ``reflect``.
        max_batches: evaluation (``shuffle=False``) only: at most this many batches per rank, of
            samples spread evenly over the split, the same every pass; None: the whole split.
        repeats: training only: each sample this many times per epoch (repeated augmentation,
            :func:`~trainkit.data.epoch_order`), each copy augmented apart.

    Example:
        >>> loader = InMemoryLoader(data, 128, shuffle=True, padding=4, flip=True)  # doctest: +SKIP
        >>> loader.set_epoch(3)
        >>> x, y = next(iter(loader))
    """

    saved_settings = ("seed",)

    def __init__(
        self,
        data: TensorData,
        batch_size: int,
        *,
        shuffle: bool,
        drop_last: bool = False,
        seed: int = 0,
        device: torch.device | str = "cpu",
        rank: int = 0,
        world_size: int = 1,
        channels_last: bool = False,
        padding: int = 0,
        flip: bool = False,
        pad_mode: str = "constant",
        max_batches: int | None = None,
        repeats: int = 1,
    ) -> None:
        self.sample = max_batches * batch_size * world_size if max_batches else None
        check_shard(len(data), batch_size, shuffle=shuffle, drop_last=drop_last, rank=rank,
                    world_size=world_size, sample=self.sample, repeats=repeats)
        if padding < 0:
            raise ConfigError(f"padding must be >= 0, got {padding}")
        if pad_mode not in PAD_MODES:
            raise ConfigError(f"pad_mode={pad_mode!r} is not one of {', '.join(PAD_MODES)}")
        self.device = torch.device(device)
        self.images = data.images.to(self.device)
        self.labels = data.labels.to(self.device)
        shape = (1, -1, 1, 1)
        self._mean = torch.tensor(data.mean, device=self.device).view(shape) * 255
        self._std = torch.tensor(data.std, device=self.device).view(shape) * 255
        self.batch_size, self.shuffle, self.drop_last = batch_size, shuffle, drop_last
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.channels_last = channels_last
        self.padding, self.flip, self.pad_mode = padding, flip, pad_mode
        self.repeats = repeats

    @property
    def num_samples(self) -> int:
        """Samples this rank sees per epoch."""
        return shard_size(len(self.labels), shuffle=self.shuffle, rank=self.rank,
                          world_size=self.world_size, sample=self.sample)

    @property
    def augments(self) -> bool:
        return self.padding > 0 or self.flip

    def __len__(self) -> int:
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def order(self, epoch: int) -> torch.Tensor:
        """The sample indices this rank visits in ``epoch``, in order."""
        return epoch_order(len(self.labels), seed=self.seed, epoch=epoch, shuffle=self.shuffle,
                           rank=self.rank, world_size=self.world_size, sample=self.sample,
                           repeats=self.repeats)

    def _pass(self, epoch: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = self.order(epoch).to(self.device)
        for b in range(start, len(self)):
            yield self._batch(order[b * self.batch_size : (b + 1) * self.batch_size], epoch, b)

    def _batch(self, index: torch.Tensor, epoch: int,
               b: int) -> tuple[torch.Tensor, torch.Tensor]:
        images = self.images.index_select(0, index)  # faster than images[index] on CPU
        if self.augments:
            generator = torch.Generator(self.device).manual_seed(  # draws without a copy
                mix_seed(self.seed, epoch, b, self.rank))
            images = crop_flip(images, generator, padding=self.padding, flip=self.flip,
                               pad_mode=self.pad_mode)
        memory_format = torch.channels_last if self.channels_last else torch.contiguous_format
        # One cast into the wanted layout, then normalise in place.
        x = images.to(torch.float32, memory_format=memory_format)
        x.sub_(self._mean).div_(self._std)
        return x, self.labels.index_select(0, index)
