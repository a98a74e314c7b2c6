from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from trainkit.checkpoint.files import CheckpointManager, load_checkpoint, save_atomic
from trainkit.core.errors import TrainkitError


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((3,), float(step))}, "optimizer": {}, "global_step": step}


def test_atomic_save_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = save_atomic(_state(1), tmp_path / "a.pt")
    assert [p.name for p in tmp_path.iterdir()] == ["a.pt"]
    assert load_checkpoint(path)["global_step"] == 1


def test_failed_save_keeps_the_old_file(tmp_path: Path) -> None:
    path = save_atomic(_state(1), tmp_path / "a.pt")

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("disk full, say")

    with pytest.raises(RuntimeError):
        save_atomic({"model": Unpicklable()}, path)
    assert load_checkpoint(path)["global_step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt"]


def test_rotation_keeps_newest_and_last_points_to_newest(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (10, 20, 30):
        manager.save(_state(step), step)
    assert [p.name for p in manager.step_files()] == ["step_000000020.pt", "step_000000030.pt"]
    assert load_checkpoint(manager.last)["global_step"] == 30
    # last.pt and the newest step file are the same bytes but independent names
    manager.save(_state(40), 40, periodic=False)
    assert load_checkpoint(tmp_path / "step_000000030.pt")["global_step"] == 30
    assert load_checkpoint(manager.last)["global_step"] == 40


def test_unreadable_newest_falls_back_to_previous(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    manager = CheckpointManager(tmp_path, keep_last=3)
    manager.save(_state(1), 1)
    manager.save(_state(2), 2)
    # a torn write: truncate both names of the newest checkpoint
    for path in (manager.last, tmp_path / "step_000000002.pt"):
        data = path.read_bytes()
        path.unlink()
        path.write_bytes(data[: len(data) // 2])
    with caplog.at_level("WARNING", logger="trainkit"):
        state = manager.load_latest()
    assert state is not None and state["global_step"] == 1
    assert "skipping unreadable checkpoint" in caplog.text


# torch warns that the hand-made pickle uses protocol 4: expected, that file is the attack
@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_malicious_pickle_is_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps({"model": Evil(), "global_step": 0}))
    with pytest.raises(TrainkitError, match="cannot be read"):
        load_checkpoint(path)
    assert not marker.exists()


def test_not_a_checkpoint(tmp_path: Path) -> None:
    torch.save({"weights": torch.ones(1)}, tmp_path / "x.pt")
    with pytest.raises(TrainkitError, match="not a trainkit checkpoint"):
        load_checkpoint(tmp_path / "x.pt")
    with pytest.raises(TrainkitError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_synchronous_save_from_a_gpu_loads_with_plain_torch_load_without_one(
        tmp_path: Path) -> None:
    """A file saved from cuda:N must not need map_location where that GPU is missing."""
    import subprocess
    import sys

    weight = torch.arange(6.0, device="cuda").reshape(2, 3)
    save_atomic({"model": {"w": weight, "tied": weight}, "step": 3}, tmp_path / "last.pt")
    code = ("import torch, sys; s = torch.load(sys.argv[1], weights_only=True); "
            "assert s['model']['w'].device.type == 'cpu', s['model']['w'].device; "
            "assert s['model']['w'].data_ptr() == s['model']['tied'].data_ptr(); "
            "print(s['model']['w'].sum().item())")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "last.pt")],
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "15.0", out.stderr[-2000:]
