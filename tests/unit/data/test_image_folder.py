"""Reading an image folder: the layout checked (one line naming the path), the split, the
samples and bad files as the loader's workers see them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.image_files import make_folder, truncate
from trainkit.core.errors import TrainkitError
from trainkit.data.batches import BadFile
from trainkit.data.classes import check_same_classes, read_classes, write_classes
from trainkit.data.sources.image_folder import (
    ImageFiles,
    collate_images,
    read_image_folder,
)
from trainkit.data.transforms import train_transform


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_folder(tmp_path_factory.mktemp("images"), per_class=5, val_per_class=2)


def test_reads_classes_in_order_and_both_splits(folder: Path) -> None:
    data = read_image_folder(folder)
    assert data.classes == ["class_0", "class_1", "class_2"]
    assert len(data.train.files) == 15 and len(data.val.files) == 6
    assert data.train.labels == [0] * 5 + [1] * 5 + [2] * 5
    assert all(Path(f).parent.name == f"class_{y}" for f, y in zip(data.val.files,
                                                                     data.val.labels))


def test_without_val_a_stratified_split_fixed_by_the_seed(folder: Path) -> None:
    a = read_image_folder(folder / "train", val_fraction=0.4, seed=3)
    assert a == read_image_folder(folder / "train", val_fraction=0.4, seed=3)
    assert a != read_image_folder(folder / "train", val_fraction=0.4, seed=4)
    assert np.bincount(a.val.labels).tolist() == [2, 2, 2]  # 40% of each class of 5
    assert not set(a.train.files) & set(a.val.files)
    assert read_image_folder(folder / "train", val_fraction=0).val is None


def _layout_error(root: Path) -> str:
    with pytest.raises(TrainkitError) as caught:
        read_image_folder(root)
    message = str(caught.value)
    assert "\n" not in message, message  # the entry point prints it as its one last line
    return message


def test_a_root_without_class_folders(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "a.jpg").write_bytes(b"")
    assert f"{tmp_path / 'train'} has no class folders" in _layout_error(tmp_path)


def test_an_empty_class_folder(tmp_path: Path) -> None:
    make_folder(tmp_path, classes=2, per_class=1, val_per_class=1)
    (tmp_path / "train" / "zebra").mkdir()
    assert f"class folder {tmp_path / 'train' / 'zebra'} holds no images" in _layout_error(
        tmp_path)


def test_val_with_other_classes_than_train(tmp_path: Path) -> None:
    make_folder(tmp_path, classes=3, per_class=1, val_per_class=1)
    (tmp_path / "val" / "class_2").rename(tmp_path / "val" / "class_9")
    message = _layout_error(tmp_path)
    assert "missing in val: class_2" in message and "only in val: class_9" in message


def test_a_non_image_file(tmp_path: Path) -> None:
    make_folder(tmp_path, classes=2, per_class=1, val_per_class=1)
    notes = tmp_path / "train" / "class_1" / "notes.txt"
    notes.write_text("labels were checked twice")
    (tmp_path / "train" / "class_1" / ".DS_Store").write_bytes(b"\0")  # hidden: ignored
    assert _layout_error(tmp_path).endswith(f"not an image (one of .jpg .jpeg .png .ppm .bmp "
                                           f".pgm .tif .tiff .webp .gif), move it out: {notes}")


def test_bad_files_come_back_as_samples_not_exceptions(tmp_path: Path, folder: Path) -> None:
    split = read_image_folder(folder).train
    cut = truncate(Path(split.files[1]))
    try:
        strict = ImageFiles(split.files, split.labels, train_transform(16))
        assert strict[1] == BadFile(str(cut), strict[1].message) and str(cut) in strict[1].message
        batch = collate_images([strict[0], strict[1]])
        assert batch.bad and batch.images is None
        skipping = ImageFiles(split.files, split.labels, train_transform(16), skip_corrupt=True)
        image, label, skipped = skipping[1]
        assert skipped == [str(cut)] and label == split.labels[2] and image.shape == (3, 16, 16)
        batch = collate_images([skipping[0], skipping[1]])
        assert batch.images.shape == (2, 3, 16, 16) and batch.skipped == [str(cut)]
        assert torch.equal(batch.labels, torch.tensor([split.labels[0], split.labels[2]]))
    finally:
        make_folder(folder, per_class=5, val_per_class=2)  # the module's folder, whole again


def test_class_names_in_the_run_dir_and_checked_on_resume(tmp_path: Path) -> None:
    write_classes(tmp_path, ["cat", "dog"])
    assert read_classes(tmp_path) == ["cat", "dog"]
    assert read_classes({"data": {"epoch": 0, "batch": 0, "classes": ["cat"]}}) == ["cat"]
    assert read_classes({"data": None}) is None
    check_same_classes(["cat", "dog"], ["cat", "dog"])
    with pytest.raises(TrainkitError, match="missing now: dog; new: fox"):
        check_same_classes(["cat", "dog"], ["cat", "fox"])
    with pytest.raises(TrainkitError, match="the same names in another order"):
        check_same_classes(["cat", "dog"], ["dog", "cat"])
