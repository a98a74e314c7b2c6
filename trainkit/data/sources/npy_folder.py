"""``data=npy_folder``: a folder of NumPy arrays, the example of a new kind of data in one module.

``<root>/train_images.npy`` (uint8 ``[N, C, H, W]``) and ``train_labels.npy`` (integers
``[N]``), and the same for ``val_``. The splits are served as MNIST's are (:mod:`.tensors`: in
memory, or through the DataLoader with ``data.loader=dataloader``); the per-channel mean and
standard deviation are the training images'. Its :data:`SOURCE` answers the commands (the
shape and classes the arrays say, a whole split for predict and export), and
``configs/data/npy_folder.yaml`` selects it: this module, that file and the row in
:data:`~trainkit.data.sources.SOURCES` are all a new kind touches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainkit.config import TensorDataConfig
from trainkit.core.errors import TrainkitError
from trainkit.core.runtime import Runtime
from trainkit.data.batches import TensorData
from trainkit.data.sources.source import Loaded, Options, Source
from trainkit.data.sources.tensors import tensor_splits


def _arrays(root: Path, split: str, *, mmap: bool = False) -> tuple[np.ndarray, np.ndarray]:
    images, labels = root / f"{split}_images.npy", root / f"{split}_labels.npy"
    for path in (images, labels):
        if not path.is_file():
            raise TrainkitError(f"data=npy_folder: {path} not found (a folder of "
                                f"{split}_images.npy and {split}_labels.npy is needed)")
    mode = "r" if mmap else None
    return np.load(images, mmap_mode=mode), np.load(labels, mmap_mode=mode)


def read_split(data: Any, *, train: bool) -> TensorData:
    """One split, whole, with the training images' statistics.

    Raises:
        TrainkitError: a file is missing, or its arrays are not uint8 ``[N, C, H, W]`` images
            with one label each.
    """
    root = Path(str(data.root))
    images, labels = _arrays(root, "train" if train else "val")
    if images.dtype != np.uint8 or images.ndim != 4 or len(images) != len(labels):
        raise TrainkitError(f"data=npy_folder: {root} must hold uint8 [N, C, H, W] images and "
                            f"N labels, got {images.dtype} {list(images.shape)} and "
                            f"{len(labels)} labels")
    reference = images if train else _arrays(root, "train", mmap=True)[0]
    scaled = np.asarray(reference, dtype=np.float64) / 255
    mean = tuple(float(m) for m in scaled.mean(axis=(0, 2, 3)))
    std = tuple(max(float(s), 1e-6) for s in scaled.std(axis=(0, 2, 3)))
    return TensorData(torch.from_numpy(np.ascontiguousarray(images)),
                      torch.from_numpy(labels.astype(np.int64)), mean, std,
                      _classes(root) or 1)


def _classes(root: Path) -> int | None:
    labels = root / "train_labels.npy"
    return int(np.load(labels, mmap_mode="r").max()) + 1 if labels.is_file() else None


def _shape(data: Any) -> tuple[int, int, int]:
    images = _arrays(Path(str(data.root)), "train", mmap=True)[0]
    return tuple(int(n) for n in images.shape[1:])  # type: ignore[return-value]


def load(cfg: TensorDataConfig, runtime: Runtime, options: Options) -> Loaded:
    """The two splits (served as ``data.loader`` picks) and the class count."""
    train, val = read_split(cfg, train=True), read_split(cfg, train=False)
    return tensor_splits(train, val, cfg, options)


SOURCE = Source("npy_folder", TensorDataConfig, load, shape=_shape, classes_on_disk=_classes,
                read_split=read_split, in_memory=True)
