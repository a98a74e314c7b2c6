"""A sharded async save (sharded.staged_save): the state is copied to the CPU on the training
thread, ordered after the work queued on the device (as ``dcp.async_save``'s default stager
does it: blocking copies, no staging stream), and ``dcp.save`` of the copy runs on trainkit's
background thread over a gloo group of its own, never the group training's collectives use."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainkit.checkpoint import sharded
from trainkit.checkpoint.async_writer import Background


@pytest.fixture
def one_rank(request: pytest.FixtureRequest) -> Iterator[None]:
    backend = getattr(request, "param", "gloo")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _save_in_background(state: dict, folder: Path, after_staging: object) -> None:
    """staged_save of ``state`` on the async save's own group; ``after_staging()`` changes the
    state before the background write runs."""
    group = sharded._group(distributed=True, async_save=True)
    assert dist.get_backend(group) == "gloo"  # its own group, CPU collectives
    assert group is not dist.group.WORLD
    write = sharded.staged_save(state, storage_writer=dcp.FileSystemWriter(folder),
                                process_group=group)
    after_staging()
    background = Background()
    background.start(write, step=1)
    background.wait()


def test_the_write_holds_the_state_at_staging_not_later_changes(one_rank: None,
                                                                tmp_path: Path) -> None:
    weight = torch.arange(8, dtype=torch.float32)
    _save_in_background({"model": {"w": weight}}, tmp_path, lambda: weight.mul_(100))
    loaded = {"model": {"w": torch.zeros(8)}}
    dcp.load(loaded, checkpoint_id=tmp_path, process_group=dist.new_group(backend="gloo"))
    assert torch.equal(loaded["model"]["w"], torch.arange(8, dtype=torch.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("one_rank", ["cpu:gloo,cuda:nccl"], indirect=True)
def test_staging_copies_what_the_queued_kernels_wrote_on_cuda(one_rank: None,
                                                              tmp_path: Path) -> None:
    """A GPU sleep then a fill queued, staging at once (no sync of ours), a later fill queued
    after it: the checkpoint holds the first fill's values (FSDP's one-rank group, as a
    one-GPU run of trainer.strategy=fsdp makes it)."""
    weight = torch.zeros(1 << 22, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # ~0.5-1 s of GPU cycles, then the fill behind it
    weight.fill_(7.0)
    _save_in_background({"model": {"w": weight}}, tmp_path, lambda: weight.fill_(9.0))
    loaded = {"model": {"w": torch.zeros(1 << 22)}}
    dcp.load(loaded, checkpoint_id=tmp_path, process_group=dist.new_group(backend="gloo"))
    assert torch.equal(loaded["model"]["w"], torch.full((1 << 22,), 7.0))
    assert torch.equal(weight.cpu(), torch.full((1 << 22,), 9.0))
