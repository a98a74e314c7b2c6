"""Image folders in torchvision's ImageFolder layout: ``<root>/train/<class>/*``, ``val/...``.

:func:`read_image_folder` lists the files (classes sorted by name, as ImageFolder numbers them)
and checks the layout, each problem one line naming its path. :class:`ImageFiles` is the
map-style dataset over one split: each sample a decoded, transformed uint8 ``[C, H, W]`` tensor
and its label. Bad files never raise inside a loader worker (where the error would arrive as a
traceback wrapped in another): the sample comes back as a :class:`BadFile`, and
:func:`collate_images` carries it to the main process, which stops with one line or, with
``skip_corrupt``, counts it (:class:`~trainkit.data.DevicePrefetcher`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from torch.utils.data import Dataset

from trainkit.config import DatasetConfig, ImageFolderConfig
from trainkit.core.errors import TrainkitError
from trainkit.core.location import fetched
from trainkit.core.runtime import Runtime
from trainkit.data.remote import fetch_tree
from trainkit.data.sources.image_files import ImageFiles, Transform, collate_images
from trainkit.data.sources.jpeg_files import JpegFiles, collate_encoded
from trainkit.data.sources.source import GpuDecode, Loaded, MapStyle, Options, Source
from trainkit.data.transforms import (
    IMAGE_SUFFIXES,
    stats_for,
    transform_for,
)


@dataclass(frozen=True)
class Split:
    """The files of one split and their class indices."""

    files: list[str]
    labels: list[int]


class FolderData(NamedTuple):
    """What :func:`read_image_folder` found: class names by index, the two splits."""

    classes: list[str]
    train: Split
    val: Split | None


def read_image_folder(root: str | Path, *, val_fraction: float = 0.1,
                      seed: int = 0) -> FolderData:
    """List ``<root>/train/<class>/*`` and ``<root>/val/<class>/*`` (or ``<root>/<class>/*``).

    Without a ``val/`` folder, ``val_fraction`` of each class (at least one file of a class of
    two or more) validates, chosen by ``seed``; ``val_fraction=0`` means no validation.

    Raises:
        TrainkitError: the root is missing, has no class folders, a class folder is empty or
            holds a non-image file, or ``val/``'s classes differ from ``train/``'s.
    """
    # a URL: the folder's files copied once into the local cache, read from there
    root = fetched(root, fetch_tree)
    if not root.is_dir():
        raise TrainkitError(f"data.root={root} is not a folder: point it at a folder holding "
                            "train/<class>/ (and val/<class>/) image folders")
    train_dir = root / "train" if (root / "train").is_dir() else root
    classes = _class_folders(train_dir)
    train = _list_split(train_dir, classes)
    val_dir = root / "val"
    if train_dir == root or not val_dir.is_dir():
        if val_fraction <= 0:
            return FolderData(classes, train, None)
        train, val = _split_off(train, val_fraction, seed)
        return FolderData(classes, train, val)
    val_classes = _class_folders(val_dir)
    if val_classes != classes:
        gone = sorted(set(classes) - set(val_classes))
        extra = sorted(set(val_classes) - set(classes))
        raise TrainkitError(f"{val_dir} has other class folders than {train_dir} (missing in "
                            f"val: {_few(gone)}; only in val: {_few(extra)}): give both the "
                            "same class folders")
    return FolderData(classes, train, _list_split(val_dir, classes))


def _class_folders(folder: Path) -> list[str]:
    names = sorted(entry.name for entry in os.scandir(folder)
                   if entry.is_dir() and not entry.name.startswith("."))
    if not names:
        raise TrainkitError(f"{folder} has no class folders: put each class's images in a "
                            "folder of its own, named for the class")
    return names


def _list_split(folder: Path, classes: list[str]) -> Split:
    files: list[str] = []
    labels: list[int] = []
    for index, name in enumerate(classes):
        found = _image_files(folder / name)
        if not found:
            raise TrainkitError(f"class folder {folder / name} holds no images: add some, or "
                                "remove the folder")
        files += found
        labels += [index] * len(found)
    return Split(files, labels)


def _image_files(folder: Path) -> list[str]:
    """The image files under ``folder`` (recursively, sorted); any other file is an error."""
    found = []
    for top, dirs, names in os.walk(folder, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if name.startswith("."):
                continue  # .DS_Store and the like
            path = os.path.join(top, name)
            if not name.lower().endswith(IMAGE_SUFFIXES):
                raise TrainkitError(f"a class folder holds a file that is not an image (one "
                                    f"of {' '.join(IMAGE_SUFFIXES)}), move it out: {path}")
            found.append(path)
    return found


def _split_off(split: Split, fraction: float, seed: int) -> tuple[Split, Split]:
    """Per class, ``fraction`` of the files to a validation split, picked by ``seed``."""
    labels = np.asarray(split.labels)
    rng = np.random.default_rng(seed)
    val_mask = np.zeros(len(labels), dtype=bool)
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        # each side keeps at least one file of a class of two or more
        take = (min(max(round(len(members) * fraction), 1), len(members) - 1)
                if len(members) >= 2 else 0)
        val_mask[rng.permutation(members)[:take]] = True
    pick = lambda mask: Split([split.files[i] for i in np.flatnonzero(mask)],  # noqa: E731
                              labels[mask].tolist())
    return pick(~val_mask), pick(val_mask)


def _few(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" (+{len(names) - 5})" if len(names) > 5 else "") or "none"


def load(cfg: ImageFolderConfig, runtime: Runtime, options: Options) -> Loaded:
    """Training and validation splits of the image folder at ``cfg.root``, and its class count.

    The built loaders' ``classes`` attribute names the classes by index. Validation is None when the
    folder has no ``val/`` and ``cfg.val_fraction`` is 0; ``options.eval_max_batches`` bounds
    it to files spread evenly over it (every class, not the first ones).
    """
    folder = read_image_folder(cfg.root, val_fraction=cfg.val_fraction, seed=options.seed)
    files_kind: Any = ImageFiles
    if cfg.decode == "gpu":  # JPEGs decoded on the device (trainkit.data.device.gpu_decode)
        files_kind = JpegFiles

    def split_loader(split: Split, training: bool) -> MapStyle:
        custom = options.train_transforms if training else options.eval_transforms
        transform = transform_for(cfg, training=training, custom=custom)
        files = files_kind(split.files, split.labels, transform, channels=cfg.channels,
                           skip_corrupt=cfg.skip_corrupt)
        return image_samples(files, cfg, options, folder.classes, training=training,
                             transform=transform)

    train = split_loader(folder.train, True)
    val = split_loader(folder.val, False) if folder.val is not None else None
    return train, val, len(folder.classes)


def image_samples(dataset: Dataset, cfg: ImageFolderConfig | DatasetConfig, options: Options,
                  classes: Sequence[str] | None, *, training: bool,
                  transform: Transform | None = None) -> MapStyle:
    """A split of image samples as the pipeline serves it: the resumable loader (workers, a
    rank's shard, pinned memory) into the device stage; with ``data.decode=gpu`` its JPEGs are
    decoded there."""
    collate: Callable[[list[Any]], Any] = collate_images
    decode = None
    if cfg.decode == "gpu" and options.reader is None:
        collate = collate_encoded
        decode = GpuDecode(cfg.channels, transform, cfg.skip_corrupt)
    mean, std = stats_for(cfg)
    return MapStyle(
        dataset, cfg.batch_size if training else cfg.eval_batch_size, shuffle=training,
        num_workers=cfg.num_workers, pin_memory=cfg.pin_memory,
        drop_last=cfg.drop_last and training, collate_fn=collate,
        max_batches=None if training else options.eval_max_batches, mean=mean, std=std,
        classes=classes, normalize_float=False, decode=decode,
        repeats=cfg.repeated_aug if training else 1)


def _classes_on_disk(root: Path) -> int | None:
    train = root / "train"
    return (sum(1 for p in train.iterdir() if p.is_dir()) or None) if train.is_dir() else None


def split_files(data: Any, seed: int, *, train: bool) -> list[str]:
    """The image files of a run's own split (``val/``, or the part it held out with ``seed``).

    Raises:
        TrainkitError: the split asked for is not there.
    """
    folder = read_image_folder(data.root, val_fraction=data.val_fraction, seed=seed)
    split = folder.train if train else folder.val
    if split is None:
        raise TrainkitError(f"inputs=test: the image folder {data.root} has no val/ and the "
                            "run held none out (data.val_fraction=0); give a folder instead")
    return list(split.files)


SOURCE = Source("image_folder", ImageFolderConfig, load, classes_on_disk=_classes_on_disk,
                split_files=split_files, gpu_decode=True)
