"""Your own dataset (``dataset._target_``): a torch ``Dataset``, a Hugging Face
``datasets.Dataset``, or a :class:`~trainkit.data.sources.tensors.TensorData`.

:class:`Samples` turns each sample into ``(image, label)``: encoded bytes and PIL images are
decoded and transformed as image folders are; tensors and arrays are taken as they are (your
dataset transformed them); ``data.train_transforms`` / ``data.eval_transforms`` apply to all.
:func:`load_split` is a ready ``dataset._target_`` for anything ``datasets`` loads from local
files (``pip install trainkit[hf]``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from trainkit.config import DatasetConfig
from trainkit.core.errors import ConfigError, TrainkitError
from trainkit.core.runtime import Runtime
from trainkit.data.batches import BadFile
from trainkit.data.sources.image_folder import image_samples
from trainkit.data.sources.source import Loaded, MapStyle, Options, Source
from trainkit.data.sources.tensors import TensorData, tensor_splits
from trainkit.data.transforms import (
    UnreadableImage,
    decode_image,
    pil_to_tensor,
    transform_for,
)


def load(cfg: DatasetConfig, runtime: Runtime, options: Options) -> Loaded:
    """The two splits your reader returns (``reader(root=data.root, train=...)``):
    a :class:`TensorData` as the built-in datasets are served, any other map-style dataset
    through :class:`Samples` (the evaluation split may be None)."""
    assert options.reader is not None  # load_data picks this source for a reader only
    train = options.reader(root=cfg.root, train=True)
    val = options.reader(root=cfg.root, train=False)
    if isinstance(train, TensorData):
        return tensor_splits(train, val, cfg, options)
    classes = class_names(train, cfg.image_column, cfg.label_column)
    num_classes = cfg.num_classes or (len(classes) if classes else
                                      getattr(train, "num_classes", None))
    if not num_classes:
        raise ConfigError(f"cannot tell the number of classes of {type(train).__name__}: set "
                          "data.num_classes (or give the dataset a `classes` list)")
    splits = [_split(split, cfg, options, classes, training=training)
              if split is not None else None for split, training in ((train, True), (val, False))]
    return splits[0], splits[1], int(num_classes)


def _split(split: Any, cfg: DatasetConfig, options: Options,
           classes: Sequence[str] | None, *, training: bool) -> MapStyle:
    """One split's samples (decoded, transformed), for the loader and the device stage."""
    custom = options.train_transforms if training else options.eval_transforms
    samples = Samples(split, transform_for(cfg, training=training, custom=custom),
                      channels=cfg.channels, image_column=cfg.image_column,
                      label_column=cfg.label_column, transform_all=bool(custom),
                      skip_corrupt=cfg.skip_corrupt)
    return image_samples(samples, cfg, options, classes, training=training)


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
    the skipped one's name, as :class:`~trainkit.data.sources.image_folder.ImageFiles` does.
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


SPLITS_TO_EVALUATE = ("validation", "test")  # tried in this order when eval_split is not given


def load_split(root: str | None = None, train: bool = True, *, path: str,
               train_split: str = "train", eval_split: str | None = None,
               val_fraction: float = 0.1, seed: int = 0, **kwargs: Any) -> Any:
    """One split of ``datasets.load_dataset(path, **kwargs)`` (or ``load_from_disk(path)``).

    Args:
        root: ``data.root``; used as ``data_dir`` when neither it nor ``data_files`` is given.
        train: the training split, else the evaluation split.
        path: ``load_dataset``'s path: a builder (``parquet``, ``imagefolder``, ...) or a folder
            saved with ``save_to_disk`` (then loaded with ``load_from_disk``).
        train_split: the training split's name.
        eval_split: the evaluation split's name; None: ``validation``, else ``test``, else
            ``val_fraction`` of the training split held out (and left out of training).
        val_fraction, seed: the held-out fraction and the seed that picks it.
        kwargs: more ``load_dataset`` arguments (``data_files``, ``data_dir``, ``cache_dir``...).

    Raises:
        TrainkitError: ``datasets`` is not installed, or a split named is not in the dataset.
    """
    try:
        import datasets
    except ImportError:
        raise TrainkitError("a Hugging Face dataset needs the datasets package: "
                            "pip install 'trainkit[hf]'") from None
    if (Path(path) / "dataset_dict.json").is_file():  # saved with DatasetDict.save_to_disk
        splits = datasets.load_from_disk(path)
    else:
        if root and "data_files" not in kwargs and "data_dir" not in kwargs:
            kwargs["data_dir"] = root
        splits = datasets.load_dataset(path, **kwargs)
    names = list(splits)
    if eval_split is None:  # validation, else test, else None: held out of the training split
        eval_split = next((name for name in SPLITS_TO_EVALUATE if name in names), None)
    for key, name in (("train_split", train_split), ("eval_split", eval_split)):
        if name is not None and name not in names:
            raise ConfigError(f"the dataset {path} has no split {name!r} (its splits: "
                              f"{', '.join(names)}): set +dataset.{key}= to one of them")
    if eval_split is None:
        return _hold_out(splits[train_split], val_fraction, seed)[0 if train else 1]
    return splits[train_split if train else eval_split]


def _hold_out(split: Any, fraction: float, seed: int) -> tuple[Any, Any]:
    """``split`` as (training, held-out ``fraction``), per class when a column is a
    ``ClassLabel`` (each class keeps its share, as image folders' ``val_fraction``)."""
    if not 0 < fraction < 1:
        raise ConfigError(f"dataset.val_fraction={fraction}: the dataset has no validation or "
                          "test split to evaluate on; hold out a fraction in (0, 1)")
    labels = [name for name, feature in split.features.items()
              if type(feature).__name__ == "ClassLabel"]
    parts = split.train_test_split(test_size=fraction, seed=seed,
                                   stratify_by_column=labels[0] if labels else None)
    return parts["train"], parts["test"]


# a reader (dataset._target_) replaces the image kinds: reader(root, train) -> one split
SOURCE = Source("dataset", DatasetConfig, load, in_memory=True)
