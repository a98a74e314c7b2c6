"""Datasets held as uint8 tensors, read with torchvision from the files it downloads.

Per-sample PIL decoding costs tens of microseconds a sample; holding the set as one tensor and
gathering batches by index costs next to nothing, which is most of what makes MNIST train in
seconds on a CPU.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from trainkit.errors import TrainkitError, one_line

# md5 of the uncompressed files torchvision leaves in <root>/MNIST/raw.
MNIST_MD5 = {
    "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
    "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
    "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
    "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
}
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)


@dataclass(frozen=True)
class TensorData:
    """A whole split in memory: ``images`` uint8 ``[N, C, H, W]``, ``labels`` int64 ``[N]``."""

    images: torch.Tensor
    labels: torch.Tensor
    mean: tuple[float, ...]
    std: tuple[float, ...]
    num_classes: int

    def __len__(self) -> int:
        return len(self.labels)


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
    from torchvision.datasets import MNIST  # torchvision import costs ~1 s: only when used

    raw = Path(root) / "MNIST" / "raw"
    missing = [name for name in MNIST_MD5 if not (raw / name).is_file()]
    if missing and download:
        try:
            MNIST(str(root), train=train, download=True)
        except Exception as err:  # offline, proxy, disk full: all end the same way for the user
            why = f"download failed: {one_line(err)}"
            raise TrainkitError(_missing_message(raw, missing, why)) from None
        missing = [name for name in MNIST_MD5 if not (raw / name).is_file()]
    if missing:
        raise TrainkitError(_missing_message(raw, missing, "download is off (data.download=false)"))
    split = "train" if train else "t10k"
    if verify:
        for name in (f"{split}-images-idx3-ubyte", f"{split}-labels-idx1-ubyte"):
            _check_md5(raw / name, MNIST_MD5[name])
    try:
        ds = MNIST(str(root), train=train, download=False)
    except Exception as err:
        raise TrainkitError(f"cannot read MNIST files in {raw}: {one_line(err)}") from None
    if len(ds.data) != len(ds.targets):
        raise TrainkitError(f"MNIST {split} files in {raw} disagree: "
                            f"{len(ds.data)} images but {len(ds.targets)} labels")
    return TensorData(ds.data.unsqueeze(1), ds.targets, MNIST_MEAN, MNIST_STD, num_classes=10)


def _check_md5(path: Path, expected: str) -> None:
    digest = hashlib.md5(path.read_bytes(), usedforsecurity=False).hexdigest()
    if digest != expected:
        raise TrainkitError(
            f"{path} has md5 {digest}, not the official {expected}: the file is corrupt or not "
            "the official one; re-download it, or set data.verify=false to load it anyway"
        )


def _missing_message(raw: Path, missing: list[str], why: str) -> str:
    return (
        f"MNIST not found: {raw} lacks {', '.join(missing)} ({why}). Put the four files "
        f"{', '.join(MNIST_MD5)} (uncompressed) in {raw}, or point data.root / TRAINKIT_DATA_DIR "
        "at a folder that holds MNIST/raw"
    )
