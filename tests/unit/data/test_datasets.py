from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.fakes import fake_mnist_arrays, write_fake_mnist
from trainkit.core.errors import LINE_LIMIT, TrainkitError
from trainkit.data.sources.tensors import MNIST_MD5, load_mnist


def test_reads_torchvision_layout_as_uint8_tensors(mnist_root: Path) -> None:
    data = load_mnist(mnist_root, train=True, verify=False, download=False)
    images, labels = fake_mnist_arrays(512, seed=0)
    assert data.images.shape == (512, 1, 28, 28) and data.images.dtype == torch.uint8
    assert torch.equal(data.images[:, 0], torch.from_numpy(images))
    assert torch.equal(data.labels, torch.from_numpy(labels).long())
    assert load_mnist(mnist_root, train=False, verify=False, download=False).images.shape[0] == 256


def test_verify_rejects_files_that_are_not_the_official_ones(mnist_root: Path) -> None:
    with pytest.raises(TrainkitError, match="not the official") as info:
        load_mnist(mnist_root, train=True, verify=True, download=False)
    assert "data.verify=false" in str(info.value)


def test_missing_files_name_all_four_and_where(tmp_path: Path) -> None:
    with pytest.raises(TrainkitError) as info:
        load_mnist(tmp_path, download=False)
    message, details = str(info.value), info.value.details
    assert "\n" not in message and len(f"trainkit: {message}") <= LINE_LIMIT
    assert "python -m trainkit.data download mnist --root DIR" in message
    for name in MNIST_MD5:  # the details say which files are missing, and where
        assert name in details[0]
    assert str(tmp_path / "MNIST" / "raw") in details[0]


def test_truncated_file_is_a_clear_error(tmp_path: Path, mnist_root: Path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(mnist_root, root)
    path = root / "MNIST" / "raw" / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(TrainkitError, match="cannot read MNIST files"):
        load_mnist(root, verify=False, download=False)


def test_label_count_mismatch_is_caught(tmp_path: Path) -> None:
    root = write_fake_mnist(tmp_path, n_train=64, n_test=32)
    other = write_fake_mnist(tmp_path / "other", n_train=63, n_test=32)
    raw = Path("MNIST") / "raw" / "train-labels-idx1-ubyte"
    shutil.copy(other / raw, root / raw)
    with pytest.raises(TrainkitError, match="64 images but 63 labels"):
        load_mnist(root, verify=False, download=False)


@pytest.mark.realdata
def test_real_mnist_checksums_and_shapes(real_mnist_root: Path) -> None:
    train = load_mnist(real_mnist_root, train=True, verify=True, download=False)
    test = load_mnist(real_mnist_root, train=False, verify=True, download=False)
    assert len(train) == 60_000 and len(test) == 10_000
    assert torch.bincount(test.labels).tolist()[0] == 980
