"""Background checkpoint writes: what lands on disk is the state at save(), errors come back."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from trainkit.checkpoint.async_writer import AsyncCheckpointWriter, snapshot
from trainkit.checkpoint.files import CheckpointManager, load_checkpoint
from trainkit.core.errors import TrainkitError


class GatedManager(CheckpointManager):
    """A real manager whose writes wait for a gate: the test decides when the disk work runs."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, keep_last=5)
        self.gate = threading.Event()
        self.writing = threading.Event()

    def save(self, state: dict[str, Any], step: int, **kwargs: Any) -> Path:
        self.writing.set()
        assert self.gate.wait(timeout=30)
        return super().save(state, step, **kwargs)


def test_the_file_holds_the_state_at_save_time_not_later_changes(tmp_path: Path) -> None:
    manager = GatedManager(tmp_path)
    writer = AsyncCheckpointWriter(manager)
    weight = torch.zeros(1000)
    writer.save({"model": {"w": weight}, "global_step": 1}, 1)
    assert manager.writing.wait(timeout=30)
    weight.add_(1)  # the loop goes on training while the file is being written
    assert not manager.last.exists()
    manager.gate.set()
    writer.wait()
    assert torch.equal(load_checkpoint(manager.last)["model"]["w"], torch.zeros(1000))


def test_saves_follow_one_another_and_rotate(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    writer = AsyncCheckpointWriter(manager)
    for step in (1, 2, 3):
        writer.save({"model": {"w": torch.full((4,), float(step))}, "global_step": step}, step)
    writer.wait()
    assert [p.name for p in manager.step_files()] == ["step_000000002.pt", "step_000000003.pt"]
    assert load_checkpoint(manager.last)["global_step"] == 3
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_failed_write_is_raised_once_by_the_next_wait(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "a_file").write_text("not a folder")
    writer = AsyncCheckpointWriter(CheckpointManager(tmp_path / "a_file" / "checkpoints"))
    writer.save({"model": {}, "global_step": 1}, 1)
    with pytest.raises(TrainkitError, match="cannot write a checkpoint"):
        writer.wait()
    writer.wait()  # reported once

    writer.save({"model": {}, "global_step": 2}, 2)
    writer.close()  # for exits already failing: logged, not raised
    assert "checkpoint write failed" in caplog.text


def test_snapshot_copies_tensors_and_containers() -> None:
    state = {"model": OrderedDict(w=torch.ones(3)), "rng": (torch.tensor([1]), 5),
             "groups": [{"lr": 0.1}], "name": "x"}
    copied = snapshot(state)
    state["model"]["w"].zero_()
    state["groups"][0]["lr"] = 0.5
    assert isinstance(copied["model"], OrderedDict)
    assert torch.equal(copied["model"]["w"], torch.ones(3))
    assert copied["groups"][0]["lr"] == 0.1
    assert copied["rng"][1] == 5 and copied["name"] == "x"


def test_snapshot_writes_into_an_earlier_one_where_tensors_match() -> None:
    first = snapshot({"w": torch.zeros(4), "b": torch.zeros(2), "step": 1})
    state = {"w": torch.ones(4), "b": torch.ones(3), "step": 2}  # b changed shape
    second = snapshot(state, reuse=first)
    assert second["w"] is first["w"] and second["b"] is not first["b"]
    assert torch.equal(second["w"], torch.ones(4)) and torch.equal(second["b"], torch.ones(3))
    assert second["step"] == 2
    state["w"].zero_()
    assert torch.equal(second["w"], torch.ones(4))  # still a copy, not the live tensor


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_snapshot_brings_cuda_tensors_to_the_cpu() -> None:
    weight = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    copied = snapshot({"w": weight})
    assert copied["w"].device.type == "cpu" and copied["w"].is_pinned()
    weight.mul_(2)
    again = snapshot({"w": weight}, reuse=copied)
    weight.zero_()
    assert again["w"] is copied["w"]
    assert torch.equal(again["w"], 2 * torch.arange(1 << 20, dtype=torch.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("side_stream", [False, True], ids=["current stream", "side stream"])
def test_snapshot_waits_for_work_queued_before_it(side_stream: bool) -> None:
    """The snapshot holds what the queued kernels wrote, read on the host at once: a second of
    GPU sleep, then a fill, both queued (on a side stream too) before the snapshot is asked."""
    weight = torch.zeros(1 << 22, device="cuda")
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(1_000_000_000)  # ~0.5-1 s of GPU cycles
        weight.fill_(7.0)
        copied = snapshot({"w": weight})["w"]
    assert torch.equal(copied, torch.full((1 << 22,), 7.0))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")  # gpu_check: not run
def test_snapshot_waits_for_the_gpu_that_holds_the_tensors_not_the_current_one() -> None:
    torch.cuda.set_device(0)  # current: cuda:0; the state lives on cuda:1
    weight = torch.zeros(1 << 24, device="cuda:1")
    for _ in range(100):  # milliseconds of queued work, then a 64 MiB copy after it
        weight.add_(1)
    copied = snapshot({"w": weight})["w"]
    assert torch.equal(copied, torch.full((1 << 24,), 100.0))  # read at once, no other wait
