"""Small datasets written in the real on-disk formats, so tests never need the real files."""

from __future__ import annotations

import io
import pickle
import struct
from pathlib import Path
from typing import ClassVar

import numpy as np


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write ``array`` (uint8) in the IDX format MNIST uses: magic, big-endian dims, bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I",
                                                                          *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def fake_mnist_arrays(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Learnable digits: each class lights a different 4x4 square, plus noise."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=n).astype(np.uint8)
    images = rng.integers(0, 60, size=(n, 28, 28)).astype(np.uint8)
    for i, label in enumerate(labels):
        r, c = divmod(int(label), 5)
        images[i, 4 + 10 * r : 8 + 10 * r, 2 + 5 * c : 6 + 5 * c] = 250
    return images, labels


def write_fake_mnist(root: Path, n_train: int = 512, n_test: int = 256, seed: int = 0) -> Path:
    """Write the four MNIST files under ``root/MNIST/raw``; return ``root``."""
    raw = Path(root) / "MNIST" / "raw"
    for split, n, s in (("train", n_train, seed), ("t10k", n_test, seed + 1)):
        images, labels = fake_mnist_arrays(n, s)
        write_idx(raw / f"{split}-images-idx3-ubyte", images)
        write_idx(raw / f"{split}-labels-idx1-ubyte", labels)
    return Path(root)


class _Py2StylePickler(pickle._Pickler):  # type: ignore[name-defined]
    """Protocol 2 with byte strings as STRING opcodes, the way Python 2 wrote CIFAR-10's files.

    Python 3 would write ``bytes`` under protocol 2 as a call to ``_codecs.encode``, a global the
    real files never name.
    """

    dispatch: ClassVar[dict] = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]

    def save_str8(self, obj: bytes) -> None:
        n = len(obj)
        if n < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([n]) + obj)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", n) + obj)
        self.memoize(obj)

    dispatch[bytes] = save_str8


def py2_pickle(obj: object) -> bytes:
    """Pickle ``obj`` the way CIFAR-10's python files are pickled."""
    buffer = io.BytesIO()
    _Py2StylePickler(buffer, protocol=2).dump(obj)
    return buffer.getvalue()


def write_py2_pickle(path: Path, obj: object) -> None:
    """Write ``obj`` to ``path`` the way CIFAR-10's python files are pickled."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(py2_pickle(obj))


def fake_cifar_arrays(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Learnable colour images ``[n, 3, 32, 32]``: each class tints one channel and one band."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=n).astype(np.int64)
    images = rng.integers(0, 100, size=(n, 3, 32, 32)).astype(np.uint8)
    for i, label in enumerate(labels):
        band = 3 * int(label)
        images[i, int(label) % 3, band : band + 4, :] = 240
    return images, labels


def write_fake_cifar10(root: Path, n_train: int = 500, n_test: int = 200, seed: int = 0) -> Path:
    """Write ``data_batch_1..5``, ``test_batch`` and ``batches.meta`` under
    ``root/cifar-10-batches-py`` in CIFAR-10's python format; return ``root``."""
    folder = Path(root) / "cifar-10-batches-py"
    images, labels = fake_cifar_arrays(n_train, seed)
    for k, part in enumerate(np.array_split(np.arange(n_train), 5), start=1):
        _write_cifar_batch(folder / f"data_batch_{k}", images[part], labels[part],
                           f"training batch {k} of 5")
    images, labels = fake_cifar_arrays(n_test, seed + 1)
    _write_cifar_batch(folder / "test_batch", images, labels, "testing batch 1 of 1")
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse",
             b"ship", b"truck"]
    write_py2_pickle(folder / "batches.meta",
                     {b"num_cases_per_batch": 10000, b"label_names": names, b"num_vis": 3072})
    return Path(root)


def _write_cifar_batch(path: Path, images: np.ndarray, labels: np.ndarray, name: str) -> None:
    write_py2_pickle(path, {
        b"batch_label": name.encode(),
        b"labels": [int(v) for v in labels],
        b"data": np.ascontiguousarray(images.reshape(len(images), -1)),
        b"filenames": [f"img_{i}.png".encode() for i in range(len(images))],
    })
