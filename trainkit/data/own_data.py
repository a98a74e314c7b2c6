"""Loaders for data that is not a built-in tensor set: image folders and any map-style Dataset.

* ``data=image_folder``: :func:`image_folder_loaders` reads the folder
  (:mod:`trainkit.data.image_folder`) and decodes and transforms in the loader's workers.
* ``dataset._target_`` returning a torch ``Dataset`` or a Hugging Face ``datasets.Dataset``:
  :func:`dataset_loaders` wraps it in :class:`Samples`, which turns each sample into
  ``(image, label)``: encoded bytes and PIL images are decoded and transformed as image folders
  are; tensors and arrays are taken as they are (your dataset transformed them); your
  ``data.train_transforms`` / ``data.eval_transforms`` apply to all.

Both go through :func:`~trainkit.data.make_loader` (workers, pinned memory, each rank its shard,
exact mid-epoch resume) and :class:`~trainkit.data.image_loader.DevicePrefetcher` (the device
prefetcher, normalisation on the device, bad-file handling, class names in checkpoints).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from trainkit.config import DataConfig
from trainkit.core.errors import ConfigError
from trainkit.core.runtime import Runtime
from trainkit.data.device.gpu_decode import JpegDecoder, JpegFiles, collate_encoded
from trainkit.data.device.prefetch import DevicePrefetcher
from trainkit.data.image_folder import BadFile, ImageFiles, collate_images, read_image_folder
from trainkit.data.loader.resumable import make_loader
from trainkit.data.transforms import (
    UnreadableImage,
    decode_image,
    pil_to_tensor,
    stats_for,
    transform_for,
)

Transforms = Sequence[Callable[..., Any]] | None


def image_folder_loaders(cfg: DataConfig, runtime: Runtime, *, seed: int = 0,
                         channels_last: bool = False, train_transforms: Transforms = None,
                         eval_transforms: Transforms = None,
                         eval_max_batches: int | None = None) -> tuple[DevicePrefetcher, Any, int]:
    """Training and validation loaders of the image folder at ``cfg.root``, and its class count.

    The loaders' ``classes`` attribute names the classes by index. Validation is None when the
    folder has no ``val/`` and ``cfg.val_fraction`` is 0; ``eval_max_batches`` bounds it to
    files spread evenly over it (every class, not the first ones).
    """
    folder = read_image_folder(cfg.root, val_fraction=cfg.val_fraction, seed=seed)
    gpu = cfg.decode == "gpu"  # JPEGs decoded on the device (trainkit.data.device.gpu_decode)

    def load(split: Any, training: bool) -> DevicePrefetcher:
        transform = transform_for(cfg, training=training,
                                  custom=train_transforms if training else eval_transforms)
        files = (JpegFiles if gpu else ImageFiles)(split.files, split.labels, transform,
                                                   channels=cfg.channels,
                                                   skip_corrupt=cfg.skip_corrupt)
        decoder = JpegDecoder(runtime.device, channels=cfg.channels, transform=transform,
                              skip_corrupt=cfg.skip_corrupt) if gpu else None
        return _loader(files, cfg, runtime, seed, channels_last, folder.classes,
                       training=training, decoder=decoder,
                       max_batches=None if training else eval_max_batches)

    train = load(folder.train, True)
    val = load(folder.val, False) if folder.val is not None else None
    return train, val, len(folder.classes)


def dataset_loaders(train: Any, val: Any, cfg: DataConfig, runtime: Runtime, *, seed: int = 0,
                    channels_last: bool = False, train_transforms: Transforms = None,
                    eval_transforms: Transforms = None,
                    eval_max_batches: int | None = None) -> tuple[DevicePrefetcher, Any, int]:
    """Loaders over your own map-style datasets (a torch ``Dataset`` or a Hugging Face
    ``datasets.Dataset``); ``val`` may be None, ``eval_max_batches`` bounds it to samples
    spread evenly over it.

    The class count is ``cfg.num_classes`` when set, else the dataset's: ``classes`` (torchvision's
    datasets), ``num_classes``, or the label column's ``ClassLabel`` names.

    Raises:
        ConfigError: the class count cannot be told from the dataset and is not set.
    """
    classes = class_names(train, cfg.image_column, cfg.label_column)
    num_classes = cfg.num_classes or (len(classes) if classes else
                                      getattr(train, "num_classes", None))
    if not num_classes:
        raise ConfigError(f"cannot tell the number of classes of {type(train).__name__}: set "
                          "data.num_classes (or give the dataset a `classes` list)")
    loaders = []
    for dataset, training in ((train, True), (val, False)):
        if dataset is None:
            loaders.append(None)
            continue
        custom = train_transforms if training else eval_transforms
        samples = Samples(dataset, transform_for(cfg, training=training, custom=custom),
                          channels=cfg.channels, image_column=cfg.image_column,
                          label_column=cfg.label_column, transform_all=bool(custom),
                          skip_corrupt=cfg.skip_corrupt)
        loaders.append(_loader(samples, cfg, runtime, seed, channels_last, classes,
                               training=training,
                               max_batches=None if training else eval_max_batches))
    return loaders[0], loaders[1], int(num_classes)


def _loader(dataset: Dataset, cfg: DataConfig, runtime: Runtime, seed: int,
            channels_last: bool, classes: Sequence[str] | None, *,
            training: bool, decoder: JpegDecoder | None = None,
            max_batches: int | None = None) -> DevicePrefetcher:
    mean, std = stats_for(cfg)
    collate = collate_encoded if decoder is not None else collate_images
    loader = make_loader(
        dataset, cfg.batch_size if training else cfg.eval_batch_size, shuffle=training,
        device=runtime.device, seed=seed, rank=runtime.rank, world_size=runtime.world_size,
        num_workers=cfg.num_workers, pin_memory=cfg.pin_memory,
        drop_last=cfg.drop_last and training, collate_fn=collate, max_batches=max_batches)
    return DevicePrefetcher(loader, runtime.device, mean=mean, std=std, classes=classes,
                            channels_last=channels_last, normalize_float=False, decoder=decoder)


def class_names(dataset: Any, image_column: str = "image",
                label_column: str = "label") -> list[str] | None:
    """Class names by index: ``dataset.classes``, or a Hugging Face label column's names."""
    classes = getattr(dataset, "classes", None)
    if classes is None and _is_hf(dataset):
        feature = dataset.features.get(label_column)
        classes = getattr(feature, "names", None)
    return [str(c) for c in classes] if classes is not None else None


def _is_hf(dataset: Any) -> bool:
    return hasattr(dataset, "features") and hasattr(dataset, "column_names")


class Samples(Dataset):
    """Your dataset's samples as ``(image, label, [])`` for :func:`collate_images`.

    A sample is ``(image, label, ...)`` (a torch ``Dataset``) or a row ``{image_column: ...,
    label_column: ...}`` (a Hugging Face ``datasets.Dataset``; its image column is read as
    bytes and decoded here, by the same decoder as image folders). Encoded bytes and PIL images
    become uint8 tensors and get ``transform``; tensors and arrays get it only when
    ``transform_all`` (your own transform lists), else pass as they are. A sample that cannot be
    decoded is a :class:`BadFile`, or with ``skip_corrupt`` the next readable sample, carrying
    the skipped one's name, as :class:`~trainkit.data.image_folder.ImageFiles` does.
    """

    def __init__(self, dataset: Any, transform: Callable[[torch.Tensor], Any], *,
                 channels: int = 3, image_column: str = "image", label_column: str = "label",
                 transform_all: bool = False, skip_corrupt: bool = False) -> None:
        self.hf = _is_hf(dataset)
        if self.hf:
            _check_columns(dataset, image_column, label_column)
            dataset = _undecoded(dataset, image_column)
        self.dataset, self.transform, self.channels = dataset, transform, channels
        self.image_column, self.label_column = image_column, label_column
        self.transform_all, self.skip_corrupt = transform_all, skip_corrupt

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, Any, list[str]] | BadFile:
        skipped: list[str] = []
        for step in range(len(self)):  # with skip_corrupt, a bad sample's place: the next one's
            i = (index + step) % len(self)
            try:
                return (*self.sample(i), skipped)
            except UnreadableImage as err:  # in a worker: the main process says it in one line
                if not self.skip_corrupt:
                    return BadFile(f"sample {i}", str(err))
                skipped.append(f"sample {i}")
        return BadFile(f"sample {index}", "no sample of this split can be decoded")

    def sample(self, index: int) -> tuple[Any, Any]:
        """Sample ``index``'s image (as :meth:`image` makes it) and label (raises
        :class:`~trainkit.data.transforms.UnreadableImage`)."""
        sample = self.dataset[index]
        if self.hf:
            image, label = sample[self.image_column], sample[self.label_column]
        else:
            image, label = sample[0], sample[1]
        return self.image(image, f"sample {index}"), label

    def image(self, image: Any, name: str) -> Any:
        """One sample's image as the model gets it (before normalisation on the device)."""
        if isinstance(image, Mapping) and image.get("bytes") is not None:  # HF Image, undecoded
            image = image["bytes"]
        elif isinstance(image, Mapping) and image.get("path"):
            with open(image["path"], "rb") as file:
                image = file.read()
        if isinstance(image, (bytes, bytearray, memoryview)):
            return self.transform(decode_image(image, channels=self.channels, name=name))
        if isinstance(image, Image.Image):
            return self.transform(pil_to_tensor(image, channels=self.channels))
        if isinstance(image, np.ndarray):
            image = torch.from_numpy(image)
        if isinstance(image, torch.Tensor) and self.transform_all:
            return self.transform(image)
        if image is None:
            raise UnreadableImage(f"{name} has no image")
        return image


def _check_columns(dataset: Any, image_column: str, label_column: str) -> None:
    missing = [c for c in (image_column, label_column) if c not in dataset.column_names]
    if missing:
        raise ConfigError(f"the dataset has no column {', '.join(map(repr, missing))} (its "
                          f"columns: {', '.join(dataset.column_names)}): set data.image_column "
                          "and data.label_column")


def _undecoded(dataset: Any, image_column: str) -> Any:
    """A Hugging Face dataset whose ``Image`` column yields the file bytes (decoded by
    :func:`~trainkit.data.transforms.decode_image`, not into a PIL image by ``datasets``)."""
    feature = dataset.features[image_column]
    if type(feature).__name__ == "Image" and getattr(feature, "decode", False):
        from datasets import Image as ImageFeature  # present: the dataset is one of its

        return dataset.cast_column(image_column, ImageFeature(decode=False))
    return dataset
