"""Small datasets written in the real on-disk formats, so tests never need the real files."""

from __future__ import annotations

import struct
from pathlib import Path

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
