"""``data=mnist`` and ``data=cifar10``: datasets held as uint8 tensors, read from the files
torchvision downloads, served from memory (:class:`~trainkit.data.InMemoryLoader`) or through
the DataLoader path (``data.loader=dataloader``).

Holding the set as one tensor and gathering batches by index avoids decoding a sample at a time
(benchmarks/README.md, data figures). CIFAR-10's files are pickles: they are read with a restricted
unpickler (:mod:`trainkit.data.sources.safe_pickle`), never with ``pickle.load``.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from trainkit.config import DatasetConfig, TensorDataConfig
from trainkit.core.errors import TrainkitError, chain_lines
from trainkit.core.runtime import Runtime
from trainkit.data.batches import TensorData
from trainkit.data.sources.safe_pickle import load_restricted
from trainkit.data.sources.source import InMemory, Loaded, MapStyle, Options, Source
from trainkit.data.tools.checksums import check_md5
from trainkit.data.tools.download import (
    CIFAR10_FOLDER,
    download_cifar10,
    download_error_lines,
    download_mnist,
)

# md5 of the uncompressed files torchvision leaves in <root>/MNIST/raw.
MNIST_MD5 = {
    "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
    "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
    "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
    "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
}
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def load_mnist(
    root: str | Path, *, train: bool = True, verify: bool = True, download: bool = True
) -> TensorData:
    """Read MNIST from ``<root>/MNIST/raw`` (torchvision's layout), downloading it if allowed.

    Args:
        root: the folder holding ``MNIST/raw``.
        train: the 60,000-image training split, else the 10,000-image test split.
        verify: check the official md5 checksums; ``False`` accepts any files in the same format
            (for example small ones a test generated).
        download: fetch the files with torchvision when they are missing.

    Raises:
        TrainkitError: files missing and not downloadable, corrupt, or not in MNIST's format.

    Example:
        >>> data = load_mnist("./data", train=False)  # doctest: +SKIP
        >>> data.images.shape
        torch.Size([10000, 1, 28, 28])
    """
    raw = Path(root) / "MNIST" / "raw"
    _have_files("MNIST", "mnist", raw, list(MNIST_MD5),
                (lambda: download_mnist(root)) if download else None)
    split = "train" if train else "t10k"
    images_file, labels_file = f"{split}-images-idx3-ubyte", f"{split}-labels-idx1-ubyte"
    try:
        images = read_idx(raw / images_file, ndim=3,
                          md5=MNIST_MD5[images_file] if verify else None)
        labels = read_idx(raw / labels_file, ndim=1,
                          md5=MNIST_MD5[labels_file] if verify else None).long()
    except (ValueError, OSError) as err:  # not IDX, or unreadable (permissions, a folder)
        raise TrainkitError(f"cannot read MNIST files in {raw}: re-download them (python -m "
                            "trainkit.data download mnist)", details=chain_lines(err)) from None
    if len(images) != len(labels):
        raise TrainkitError(f"MNIST {split} files in {raw} disagree: "
                            f"{len(images)} images but {len(labels)} labels")
    return TensorData(images.unsqueeze(1), labels, MNIST_MEAN, MNIST_STD, num_classes=10)


def read_idx(path: Path, *, ndim: int, md5: str | None = None) -> torch.Tensor:
    """A uint8 IDX file (MNIST's format: magic ``0 0 8 ndim``, big-endian int32 sizes, bytes),
    checked against ``md5`` when given.

    Read here rather than through torchvision's MNIST class: importing torchvision costs about
    a second, a tenth of a whole MNIST run. The file is read once, into the buffer the tensor
    keeps, and checked there.

    Raises:
        ValueError: not a uint8 IDX file of ``ndim`` dimensions, or shorter than its sizes say.
        TrainkitError: the md5 is not ``md5``.
    """
    with path.open("rb") as file:
        data = bytearray(os.fstat(file.fileno()).st_size)
        file.readinto(data)
    if md5 is not None:
        check_md5(path, md5, data)
    header = 4 + 4 * ndim
    if len(data) < header or data[:4] != bytes([0, 0, 0x08, ndim]):
        raise ValueError(f"{path.name}: not a uint8 IDX file of {ndim} dimension(s)")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    if len(data) - header != math.prod(shape):
        raise ValueError(f"{path.name}: {len(data) - header} bytes of data, but its header "
                         f"says {' x '.join(map(str, shape))}")
    return torch.frombuffer(data, dtype=torch.uint8, offset=header).view(shape)


def _have_files(title: str, name: str, folder: Path, files: list[str],
                fetch: Callable[[], object] | None) -> None:
    """Every one of ``files`` in ``folder``, fetched once by ``fetch`` (None: downloads are
    off) when some are missing; else the one-line error of :func:`_not_found`."""
    missing = [file for file in files if not (folder / file).is_file()]
    if missing and fetch is not None:
        try:
            fetch()
        except Exception as err:  # offline, proxy, disk full: all end the same way for the user
            raise _not_found(title, name, folder, missing, err) from None
        missing = [file for file in files if not (folder / file).is_file()]
    if missing:
        raise _not_found(title, name, folder, missing, None)


def _not_found(title: str, name: str, folder: Path, missing: list[str],
               download_error: Exception | None) -> TrainkitError:
    """Missing files: the last line says how to fetch them; the details say which and why."""
    why = "the download failed" if download_error else "data.download=false"
    details = [f"{folder} lacks {', '.join(missing)}"]
    if download_error is not None:
        details += ["download error: " + line for line in download_error_lines(download_error)]
    layout = "MNIST/raw" if name == "mnist" else CIFAR10_FOLDER
    details.append(f"data.root (or TRAINKIT_DATA_DIR) must be the folder that holds {layout}/; "
                   "the files may also be copied there by hand (uncompressed)")
    return TrainkitError(
        f"{title} not found under data.root ({why}): run `python -m trainkit.data download "
        f"{name} --root DIR` where there is internet, copy DIR here, set data.root=DIR",
        details=details)


def cifar10_files(train: bool) -> dict[str, str]:
    """File name -> official md5 of one CIFAR-10 split (plus ``batches.meta``), from torchvision."""
    from torchvision.datasets import CIFAR10

    files = dict(CIFAR10.train_list if train else CIFAR10.test_list)
    files[CIFAR10.meta["filename"]] = CIFAR10.meta["md5"]
    return files


def load_cifar10(
    root: str | Path, *, train: bool = True, verify: bool = True, download: bool = True
) -> TensorData:
    """Read CIFAR-10 from ``<root>/cifar-10-batches-py`` (torchvision's layout).

    Args:
        root: the folder holding ``cifar-10-batches-py``.
        train: the five 10,000-image training batches, else the 10,000-image test batch.
        verify: check the official md5 checksums; ``False`` accepts any files in the same format.
        download: fetch and unpack the archive with torchvision when files are missing.

    Raises:
        TrainkitError: files missing and not downloadable, corrupt, not in CIFAR-10's format, or
            holding anything but the plain types CIFAR-10's pickles hold.

    Example:
        >>> data = load_cifar10("./data", train=False)  # doctest: +SKIP
        >>> data.images.shape
        torch.Size([10000, 3, 32, 32])
    """
    folder = Path(root) / CIFAR10_FOLDER
    files = cifar10_files(train)
    _have_files("CIFAR-10", "cifar10", folder, list(files),
                (lambda: download_cifar10(root)) if download else None)
    if verify:
        for name, md5 in files.items():
            check_md5(folder / name, md5)
    *batch_names, meta_name = files
    meta = _read_pickle(folder / meta_name)
    names = meta.get(b"label_names") if isinstance(meta, dict) else None
    if not isinstance(names, list) or not names:
        raise TrainkitError(f"{folder / meta_name} is not CIFAR-10's batches.meta: "
                            "expected a dict with a non-empty list b'label_names'")
    parts = [_read_cifar_batch(folder / name, len(names)) for name in batch_names]
    images = torch.from_numpy(np.concatenate([p[0] for p in parts])).view(-1, 3, 32, 32)
    labels = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    return TensorData(images, labels, CIFAR10_MEAN, CIFAR10_STD, num_classes=len(names))


def _read_pickle(path: Path) -> object:
    try:
        with open(path, "rb") as f:
            return load_restricted(f)
    except TrainkitError as err:
        raise TrainkitError(f"refusing {path}: {err}") from None
    except Exception as err:  # truncated or not a pickle at all
        raise TrainkitError(f"cannot read CIFAR-10 file {path}: re-download it (python -m "
                            "trainkit.data download cifar10)", details=chain_lines(err)) from None


def _read_cifar_batch(path: Path, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 [N, 3072], labels int64 [N])`` from one batch file, shape-checked."""
    batch = _read_pickle(path)
    data = batch.get(b"data") if isinstance(batch, dict) else None
    labels = batch.get(b"labels") if isinstance(batch, dict) else None
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2
            and data.shape[1] == 3 * 32 * 32 and isinstance(labels, list)):
        raise TrainkitError(f"{path} is not a CIFAR-10 batch: expected a dict with b'data' "
                            "(uint8 array [N, 3072]) and b'labels' (list of ints)")
    targets = np.asarray(labels, dtype=np.int64)
    if len(targets) != len(data):
        raise TrainkitError(f"{path} holds {len(data)} images but {len(targets)} labels")
    if len(targets) and not (targets.min() >= 0 and targets.max() < num_classes):
        raise TrainkitError(f"{path} has labels outside 0..{num_classes - 1}")
    return data, targets


def load(cfg: TensorDataConfig, runtime: Runtime, options: Options) -> Loaded:
    """The splits of ``data.name`` (MNIST or CIFAR-10): in memory on the device
    (``data.loader=memory``, the default; batches augmented there) or through the DataLoader
    path (workers, pinned memory, the prefetcher)."""
    read = READERS[cfg.name]
    train = read(cfg.root, train=True, verify=cfg.verify, download=cfg.download)
    test = read(cfg.root, train=False, verify=cfg.verify, download=cfg.download)
    return tensor_splits(train, test, cfg, options)


def tensor_splits(train: TensorData, test: TensorData, cfg: TensorDataConfig | DatasetConfig,
                  options: Options) -> Loaded:
    """The two splits, served as ``data.loader`` picks, and the class count."""
    if cfg.loader == "dataloader":
        return (_samples(train, cfg, options, training=True),
                _samples(test, cfg, options, training=False), train.num_classes)
    return (
        InMemory(train, cfg.batch_size, shuffle=True, drop_last=cfg.drop_last,
                 padding=cfg.random_crop_padding, flip=cfg.random_flip, pad_mode=cfg.pad_mode,
                 repeats=cfg.repeated_aug),
        InMemory(test, cfg.eval_batch_size, shuffle=False, max_batches=options.eval_max_batches),
        train.num_classes,
    )


READERS = {"mnist": load_mnist, "cifar10": load_cifar10}  # the built-in datasets, by data.name


def _split_of(read: Callable[..., TensorData]) -> Callable[..., TensorData]:
    def read_split(data: Any, *, train: bool) -> TensorData:
        return read(data.root, train=train, verify=data.verify, download=data.download)

    return read_split


# bytes of a split pair held on the device by data.loader=memory (uint8 images, int64 labels)
MNIST = Source("mnist", TensorDataConfig, load, shape=lambda data: (1, 28, 28), num_classes=10,
               read_split=_split_of(load_mnist), in_memory=True, eval_split="test",
               resident_bytes=(60000 + 10000) * (28 * 28 + 8))
CIFAR10 = Source("cifar10", TensorDataConfig, load, shape=lambda data: (3, 32, 32),
                 num_classes=10, read_split=_split_of(load_cifar10), in_memory=True,
                 eval_split="test", resident_bytes=(50000 + 10000) * (3 * 32 * 32 + 8))


class ImageSamples(Dataset):
    """A split as a map-style dataset of ``(uint8 image, label)``, augmented one image at a time
    with torchvision's transforms (the standard per-sample path)."""

    def __init__(self, data: TensorData, *, padding: int = 0, flip: bool = False,
                 pad_mode: str = "constant") -> None:
        from torchvision.transforms import v2  # heavy import: only on this path

        self.images, self.labels = data.images, data.labels
        ops: list[Any] = []
        if padding:
            size = tuple(data.images.shape[-2:])
            ops.append(v2.RandomCrop(size, padding=padding, padding_mode=pad_mode))
        if flip:
            ops.append(v2.RandomHorizontalFlip())
        self.transform = v2.Compose(ops) if ops else None

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[i]
        return (self.transform(image) if self.transform else image), self.labels[i]


def _samples(data: TensorData, cfg: TensorDataConfig | DatasetConfig, options: Options, *,
             training: bool) -> MapStyle:
    samples = ImageSamples(data, padding=cfg.random_crop_padding, flip=cfg.random_flip,
                           pad_mode=cfg.pad_mode) if training else ImageSamples(data)
    return MapStyle(
        samples, cfg.batch_size if training else cfg.eval_batch_size, shuffle=training,
        num_workers=cfg.num_workers, pin_memory=cfg.pin_memory,
        drop_last=cfg.drop_last and training,
        max_batches=None if training else options.eval_max_batches, mean=data.mean, std=data.std,
        repeats=cfg.repeated_aug if training else 1)
