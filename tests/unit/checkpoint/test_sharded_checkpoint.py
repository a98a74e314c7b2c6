"""The directory protocol of sharded checkpoints, in one process (DCP without a process group):
names, ``last``/``best`` links, rotation, leftovers of dead saves, and what is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from trainkit.checkpoint.sharded import (
    FORMAT,
    META_FILE,
    ShardedCheckpoints,
    latest_meta,
    read_meta,
)
from trainkit.core.errors import TrainkitError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def save(ckpts: ShardedCheckpoints, step: int, *, best: bool = False) -> None:
    tensors = {"model": {"w": torch.full((4,), float(step))}}
    ckpts.save(tensors, {"format": FORMAT, "global_step": step, "epoch": 0}, step, best=best)


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_rotation_keeps_the_newest_and_the_best_and_last_names_the_newest(tmp_path: Path) -> None:
    ckpts = ShardedCheckpoints(tmp_path, keep_last=2)
    (tmp_path / ".step_000000009.tmp").mkdir()  # a save that died earlier
    for step in (1, 2, 3, 4):
        save(ckpts, step, best=step == 2)
    assert names(tmp_path) == ["best", "last", "step_000000002", "step_000000003",
                               "step_000000004"]
    assert os.readlink(tmp_path / "last") == "step_000000004"
    assert os.readlink(tmp_path / "best") == "step_000000002"
    meta = read_meta(tmp_path / "last")
    assert meta["global_step"] == 4 and "model.w" in meta["_tensors"]
    assert latest_meta(tmp_path)["global_step"] == 4


def test_the_same_step_again_rewrites_only_its_trainkit_file(tmp_path: Path) -> None:
    ckpts = ShardedCheckpoints(tmp_path, keep_last=2)
    save(ckpts, 5)
    shard = next((tmp_path / "step_000000005").glob("*.distcp"))
    before = shard.stat().st_mtime_ns
    ckpts.update_meta({"format": FORMAT, "global_step": 5, "epoch": 0, "note": 1}, 5, best=True)
    assert torch.load(tmp_path / "best" / META_FILE, weights_only=True)["note"] == 1
    assert shard.stat().st_mtime_ns == before


def test_what_is_not_a_whole_checkpoint_is_refused_in_one_line(tmp_path: Path) -> None:
    ckpts = ShardedCheckpoints(tmp_path / "checkpoints", keep_last=2)
    save(ckpts, 1)
    broken = tmp_path / "checkpoints" / "step_000000001"
    cases = {tmp_path / "nope": "does not exist", tmp_path / "checkpoints": "checkpoints folder",
             tmp_path: "not a complete sharded checkpoint"}
    for path, words in cases.items():
        with pytest.raises(TrainkitError, match=words):
            read_meta(path)
    shard = next(broken.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(TrainkitError, match="is incomplete"):
        read_meta(broken)
    (broken / META_FILE).write_bytes(b"not a pickle")
    with pytest.raises(TrainkitError, match="cannot be read") as err:
        read_meta(broken)
    assert "\n" not in str(err.value)
