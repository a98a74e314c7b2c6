"""The one naming and rotation of checkpoints (trainkit.checkpoint.layout), alone and through
both storages: ``.pt`` files (CheckpointManager) and DCP directories (ShardedCheckpoints)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from trainkit.checkpoint.files import CheckpointManager, load_checkpoint
from trainkit.checkpoint.layout import Layout, newest_readable
from trainkit.checkpoint.sharded import FORMAT, ShardedCheckpoints, latest_meta, read_meta
from trainkit.core.errors import TrainkitError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_step_names_parse_back_for_their_own_kind_only() -> None:
    files, dirs = Layout("c", suffix=".pt"), Layout("c", suffix="")
    assert files.step_path(12).name == "step_000000012.pt"
    assert dirs.step_path(12).name == "step_000000012"
    assert files.step_of("step_000000012.pt") == 12 and dirs.step_of("step_000000012") == 12
    assert files.step_of("step_7.pt") == 7  # unpadded names (written by hand) count too
    for name in ("step_000000012", "last.pt", "best.pt", "step_x.pt", "step_1.pt.tmp"):
        assert files.step_of(name) is None, name
    for name in ("step_000000012.pt", "last", ".step_000000001.tmp"):
        assert dirs.step_of(name) is None, name


def test_steps_are_ordered_by_number_and_filtered_by_kind(tmp_path: Path) -> None:
    for name in ("step_10.pt", "step_9.pt", "step_000000011.pt", "last.pt", ".step_12.pt.tmp"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "step_13.pt").mkdir()  # a directory with a file's name is not a file checkpoint
    (tmp_path / "step_000000005").mkdir()
    files, dirs = Layout(tmp_path, suffix=".pt"), Layout(tmp_path, suffix="")
    assert [p.name for p in files.steps()] == ["step_9.pt", "step_10.pt", "step_000000011.pt"]
    assert [p.name for p in dirs.steps()] == ["step_000000005"]
    assert [p.name for p in files.candidates()] == [
        "last.pt", "step_000000011.pt", "step_10.pt", "step_9.pt"]
    assert Layout(tmp_path / "missing", suffix="").candidates() == []


def test_a_last_link_puts_its_target_first_once_and_protects_it_from_rotation(
        tmp_path: Path) -> None:
    layout = Layout(tmp_path, keep_last=1, suffix="")
    for step in (1, 2, 3):
        layout.step_path(step).mkdir()
    (tmp_path / ".step_000000004.tmp").mkdir()  # a save that died
    os.symlink("step_000000002", tmp_path / "last")
    os.symlink("step_000000001", tmp_path / "best")
    assert [p.name for p in layout.candidates()] == [
        "step_000000002", "step_000000003", "step_000000001"]
    assert layout.stale() == []  # 3 is the newest; 2 and 1 are linked
    os.symlink("step_000000003", tmp_path / ".last.tmp")
    os.replace(tmp_path / ".last.tmp", tmp_path / "last")
    assert [p.name for p in layout.stale()] == ["step_000000002"]
    assert [p.name for p in layout.leftovers()] == [".step_000000004.tmp"]


def test_newest_readable_skips_what_does_not_read_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    def read(path: Path) -> dict:
        if path.name == "bad":
            raise TrainkitError(f"checkpoint {path} cannot be read (truncated)")
        return {"_path": str(path)}

    with caplog.at_level(logging.WARNING, logger="trainkit"):
        assert newest_readable([Path("bad"), Path("good")], read) == {"_path": "good"}
        assert newest_readable([Path("bad")], read) is None
    assert caplog.text.count("skipping unreadable checkpoint: checkpoint bad cannot be read") == 2


def _save(store: CheckpointManager | ShardedCheckpoints, step: int, best: bool) -> None:
    if isinstance(store, CheckpointManager):
        store.save({"model": {"w": torch.full((2,), float(step))}, "global_step": step}, step,
                   best=best)
    else:
        store.save({"model": {"w": torch.full((2,), float(step))}},
                   {"format": FORMAT, "global_step": step, "epoch": 0}, step, best=best)


@pytest.mark.parametrize("kind", ["files", "dirs"])
def test_both_storages_name_rotate_and_resume_through_the_layout(tmp_path: Path,
                                                                 kind: str) -> None:
    store = (CheckpointManager(tmp_path, keep_last=2) if kind == "files"
             else ShardedCheckpoints(tmp_path, keep_last=2))
    layout = Layout(tmp_path, keep_last=2, suffix=".pt" if kind == "files" else "")
    for step in (1, 2, 3, 4):
        _save(store, step, best=step == 2)
    assert store.last == layout.last and store.best == layout.best
    steps = [layout.step_of(p.name) for p in layout.steps()]
    # a file's best.pt is a hard link (its own name keeps the bytes); a directory's best is a
    # symlink, so its target stays
    assert steps == ([3, 4] if kind == "files" else [2, 3, 4])
    read = load_checkpoint if kind == "files" else read_meta
    assert read(layout.last)["global_step"] == 4 and read(layout.best)["global_step"] == 2
    assert read(layout.candidates()[0])["global_step"] == 4
    latest = store.load_latest() if kind == "files" else latest_meta(tmp_path)
    assert latest["global_step"] == 4


@pytest.mark.parametrize("kind", ["files", "dirs"])
def test_both_storages_report_a_failed_write_with_the_same_words(tmp_path: Path,
                                                                 kind: str) -> None:
    (tmp_path / "a_file").write_text("not a folder")
    folder = tmp_path / "a_file" / "checkpoints"
    store = (CheckpointManager(folder) if kind == "files" else ShardedCheckpoints(folder))
    with pytest.raises(TrainkitError) as err:
        _save(store, 1, best=False)
    assert str(err.value).startswith("cannot write a checkpoint (")
    assert "existing checkpoints are intact" in str(err.value)
    assert err.value.details == [f"checkpoint folder: {folder}"]
