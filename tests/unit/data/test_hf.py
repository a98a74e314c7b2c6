"""trainkit.data.sources.dataset.load_split on real ``datasets`` imagefolder datasets built
from files (no network; the cache in the test's folder)."""

from __future__ import annotations

import io
import logging
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.image_files import make_folder, picture
from trainkit.config import DataConfig
from trainkit.core.errors import ConfigError, TrainkitError
from trainkit.core.runtime import Runtime
from trainkit.data import load_data
from trainkit.data.sources.dataset import load_split

datasets = pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An image folder with val/, and the same without it."""
    tmp = tmp_path_factory.mktemp("hf")
    with_val = make_folder(tmp / "with_val", classes=3, per_class=10, val_per_class=2,
                           sizes=(16, 24))
    train_only = tmp / "train_only"
    shutil.copytree(with_val / "train", train_only / "train")
    return {"with_val": with_val, "train_only": train_only, "cache": tmp / "cache"}


def test_evaluation_takes_the_split_there_is(folders: dict[str, Path]) -> None:
    """imagefolder has no `test` split: evaluation reads `validation`, not a traceback."""
    split = load_split(str(folders["with_val"]), False, path="imagefolder",
                       cache_dir=str(folders["cache"]))
    assert split.num_rows == 6  # val/: 3 classes x 2
    assert load_split(str(folders["with_val"]), True, path="imagefolder",
                      cache_dir=str(folders["cache"])).num_rows == 30


def test_without_an_evaluation_split_a_seeded_fraction_of_each_class_is_held_out(
        folders: dict[str, Path]) -> None:
    kwargs = {"path": "imagefolder", "cache_dir": str(folders["cache"]), "val_fraction": 0.2}
    train = load_split(str(folders["train_only"]), True, **kwargs)
    val = load_split(str(folders["train_only"]), False, **kwargs)
    assert (train.num_rows, val.num_rows) == (24, 6)
    assert Counter(val["label"]) == {0: 2, 1: 2, 2: 2}  # each class its share
    # held out means left out of training: no image is in both
    seen = {row["image"].tobytes() for row in train}
    assert not any(row["image"].tobytes() in seen for row in val)
    again = load_split(str(folders["train_only"]), False, **kwargs)
    assert [r["image"].tobytes() for r in again] == [r["image"].tobytes() for r in val]


def test_a_split_named_that_is_not_there_is_one_line_naming_those_there_are(
        folders: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match=r"^the dataset imagefolder has no split 'test' \(its "
                       r"splits: train, validation\): set \+dataset.eval_split= to one of them$"):
        load_split(str(folders["with_val"]), False, path="imagefolder", eval_split="test",
                   cache_dir=str(folders["cache"]))


def test_skip_corrupt_skips_a_bad_sample_of_a_hugging_face_dataset_logs_and_counts_it(
        caplog: pytest.LogCaptureFixture) -> None:
    """data.skip_corrupt=true means for a datasets.Dataset what it means for an image folder."""
    rng = np.random.default_rng(0)
    images = []
    for i in range(6):
        buffer = io.BytesIO()
        Image.fromarray(picture(rng, i % 2, 20, 20)).save(buffer, format="PNG")
        images.append(buffer.getvalue())
    images[2] = images[2][: len(images[2]) // 2]  # a download that broke off
    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(names=["a", "b"])})
    split = datasets.Dataset.from_dict(
        {"image": [{"bytes": b, "path": None} for b in images], "label": [i % 2 for i in range(6)]},
        features=features)

    def batches(skip: bool) -> tuple[list, object]:
        cfg = DataConfig(name="image_folder", root="unused", batch_size=3, eval_batch_size=3,
                         loader="dataloader", num_workers=0, image_size=16, skip_corrupt=skip)
        train, _, _ = load_data(cfg, Runtime(torch.device("cpu")),
                                reader=lambda root, train: split if train else None)
        train.set_epoch(0)
        return [labels for _, labels in train], train

    with pytest.raises(TrainkitError, match=r"set data.skip_corrupt=true .*: sample 2$"):
        batches(skip=False)
    with caplog.at_level(logging.WARNING, logger="trainkit"):
        got, loader = batches(skip=True)
    assert sum(len(labels) for labels in got) == 6  # the epoch keeps its length
    assert loader.report() == {"data/skipped_files": 1}
    assert [r.getMessage() for r in caplog.records] == [
        "skipped unreadable file sample 2 (data.skip_corrupt=true; 1 so far)"]
