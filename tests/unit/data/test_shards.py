"""data=webdataset in one process: the shards command's files, the loader's epoch and resume,
shards of your own by brace pattern or pipe: URL, and the one-line errors."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import torch

from tests.image_files import make_folder
from trainkit.config import DataConfig
from trainkit.core.errors import ConfigError, TrainkitError
from trainkit.core.runtime import Runtime
from trainkit.data.__main__ import main as data_main
from trainkit.data.pipeline import shard_loaders

CPU = Runtime(torch.device("cpu"))


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shards")
    make_folder(root / "images", classes=2, per_class=5, val_per_class=2, sizes=(10, 14))
    assert data_main(["shards", str(root / "images"), str(root / "out"),
                      "--samples-per-shard", "3"]) == 0
    return root / "out"


def config(root: Path, **keys: object) -> DataConfig:
    return DataConfig(**{"name": "webdataset", "root": str(root), "batch_size": 2,
                         "eval_batch_size": 2, "num_workers": 0, "image_size": 8,
                         "shuffle_buffer": 3, **keys})


def test_shards_command_writes_every_image_once_with_its_class(shards: Path) -> None:
    index = json.loads((shards / "shards.json").read_text())
    assert index["classes"] == ["class_0", "class_1"]
    assert [e["samples"] for e in index["train"]] == [3, 3, 3, 1]
    assert [e["samples"] for e in index["val"]] == [3, 1]
    names = []
    for entry in index["train"]:
        with tarfile.open(shards / entry["shard"]) as tar:
            names += tar.getnames()
    keys = {n.rsplit(".", 1)[0] for n in names}
    assert len(keys) == 10 and all(k.startswith("train/class_") for k in keys)
    assert sum(n.endswith(".cls") for n in names) == 10


def test_shards_command_refuses_to_overwrite(shards: Path, capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path) -> None:
    before = (shards / "shards.json").read_bytes()
    assert data_main(["shards", str(tmp_path), str(shards)]) == 2
    assert "holds shards already" in capsys.readouterr().err
    assert (shards / "shards.json").read_bytes() == before


def test_epoch_is_fixed_batches_and_resume_hands_out_the_same_batches(shards: Path) -> None:
    train, val, classes = shard_loaders(config(shards), CPU, seed=1)
    loader = train.loader  # the ShardLoader inside the device stage
    assert classes == 2 and len(train) == 10 // 2  # all 10 samples, batches of 2
    loader.set_epoch(3)
    whole = [b.keys for b in loader]
    assert len(whole) == 5
    loader.set_epoch(3, 2)
    assert [b.keys for b in loader] == whole[2:]
    images, labels = next(iter(train))
    assert images.shape == (2, 3, 8, 8) and images.dtype == torch.float32
    assert labels.dtype == torch.int64 and set(labels.tolist()) <= {0, 1}
    assert [len(y) for _, y in val] == [2, 2]  # 4 validation images, in order


def test_class_names_are_kept_in_the_state_and_other_classes_are_refused(shards: Path) -> None:
    train, _, _ = shard_loaders(config(shards), CPU)
    assert train.classes == ["class_0", "class_1"]  # what classes.json and checkpoints get
    state = train.state_dict()
    assert state["classes"] == ["class_0", "class_1"]
    train.load_state_dict(state)
    with pytest.raises(TrainkitError, match="class"):
        train.load_state_dict({**state, "classes": ["cat", "dog"]})


def test_own_shards_by_pattern_and_pipe_url(shards: Path) -> None:
    pattern = str(shards / "train-{000000..000003}.tar")
    cfg = config(shards, shards=pattern, val_shards=[f"pipe:cat {shards / 'val-000000.tar'}"],
                 epoch_samples=6)
    train, val, _ = shard_loaders(cfg, CPU)
    assert len(train) == 3
    assert sum(len(y) for _, y in val) == 3
    with pytest.raises(ConfigError, match=r"data\.epoch_samples is needed"):
        shard_loaders(config(shards, shards=pattern), CPU)


def test_fewer_shards_than_ranks_times_workers_is_one_line(shards: Path) -> None:
    runtime = Runtime(torch.device("cpu"), rank=0, world_size=2)
    with pytest.raises(ConfigError, match=r"4 training shards for 2 rank\(s\) x 3 worker\(s\): "
                                          "each needs one"):
        shard_loaders(config(shards, num_workers=3), runtime)
