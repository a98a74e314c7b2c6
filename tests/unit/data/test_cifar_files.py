"""CIFAR-10 read from generated files in its real format, and the restricted unpickler."""

from __future__ import annotations

import io
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.fakes import fake_cifar_arrays, py2_pickle, write_py2_pickle
from trainkit.core.errors import LINE_LIMIT, TrainkitError
from trainkit.data.sources.safe_pickle import load_restricted
from trainkit.data.sources.tensors import load_cifar10

FOLDER = "cifar-10-batches-py"


def test_reads_all_five_batches_and_the_test_batch(cifar_root: Path) -> None:
    train = load_cifar10(cifar_root, train=True, verify=False, download=False)
    images, labels = fake_cifar_arrays(500, seed=0)
    assert train.images.shape == (500, 3, 32, 32) and train.images.dtype == torch.uint8
    assert torch.equal(train.images, torch.from_numpy(images))  # row order: batch 1 first
    assert torch.equal(train.labels, torch.from_numpy(labels))
    assert train.num_classes == 10 and len(train.mean) == 3
    test = load_cifar10(cifar_root, train=False, verify=False, download=False)
    assert test.images.shape == (200, 3, 32, 32)


def test_verify_rejects_generated_files(cifar_root: Path) -> None:
    with pytest.raises(TrainkitError, match="not the official") as info:
        load_cifar10(cifar_root, verify=True, download=False)
    assert "data.verify=false" in str(info.value)


def test_missing_files_name_the_download_command(tmp_path: Path) -> None:
    with pytest.raises(TrainkitError) as info:
        load_cifar10(tmp_path, download=False)
    message, details = str(info.value), info.value.details
    assert "\n" not in message and len(f"trainkit: {message}") <= LINE_LIMIT
    assert "python -m trainkit.data download cifar10 --root DIR" in message
    assert "data_batch_1" in details[0] and "batches.meta" in details[0]


def test_pickle_with_another_global_is_refused(tmp_path: Path, cifar_root: Path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(cifar_root, root)

    marker = tmp_path / "pwned"

    class Payload:  # unpickling this with pickle.load would run a shell command
        def __reduce__(self) -> tuple:
            import os

            return (os.system, (f"touch {marker}",))

    write_py2_pickle(root / FOLDER / "data_batch_3", {b"data": Payload(), b"labels": [0]})
    with pytest.raises(TrainkitError, match=r"refusing .*data_batch_3.*(posix|os)\.system"):
        load_cifar10(root, verify=False, download=False)
    assert not marker.exists()


@pytest.mark.parametrize("payload", [
    {b"labels": [1, 2], b"data": np.zeros((2, 3072), np.uint8), b"x": {1, 2}},  # builtins.set
    {b"data": np.zeros((2, 3072), np.uint8), b"labels": [1, 2], b"when": __import__("datetime")
     .date(2020, 1, 1)},
])
def test_unpickler_admits_only_numpy_array_globals(payload: dict) -> None:
    blob = py2_pickle(payload)
    with pytest.raises(TrainkitError, match="never holds"):
        load_restricted(io.BytesIO(blob))


def test_python3_bytes_pickles_are_refused_too() -> None:
    # Python 3 writes bytes under protocol 2 as calls to _codecs.encode: not CIFAR's format
    with pytest.raises(TrainkitError, match=r"_codecs\.encode"):
        load_restricted(io.BytesIO(pickle.dumps({b"labels": [1]}, protocol=2)))


def test_unpickler_round_trips_what_cifar_files_hold(tmp_path: Path) -> None:
    obj = {b"data": np.arange(12, dtype=np.uint8).reshape(2, 6), b"labels": [3, 4],
           b"filenames": [b"a.png", b"b.png"], b"batch_label": b"training batch 1 of 5"}
    write_py2_pickle(tmp_path / "batch", obj)
    with open(tmp_path / "batch", "rb") as f:
        back = load_restricted(f)
    assert back.keys() == obj.keys()
    assert np.array_equal(back[b"data"], obj[b"data"]) and back[b"labels"] == [3, 4]
    assert back[b"filenames"] == [b"a.png", b"b.png"]


def test_wrong_array_shape_is_a_clear_error(tmp_path: Path, cifar_root: Path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(cifar_root, root)
    write_py2_pickle(root / FOLDER / "test_batch",
                     {b"data": np.zeros((4, 100), np.uint8), b"labels": [0, 1, 2, 3]})
    with pytest.raises(TrainkitError, match="not a CIFAR-10 batch"):
        load_cifar10(root, train=False, verify=False, download=False)


def test_truncated_file_is_a_clear_error(tmp_path: Path, cifar_root: Path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(cifar_root, root)
    path = root / FOLDER / "data_batch_2"
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(TrainkitError, match="cannot read CIFAR-10 file"):
        load_cifar10(root, verify=False, download=False)
