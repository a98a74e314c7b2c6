"""data=webdataset under real torchrun, 2 ranks x 2 workers, shards written from a generated
image folder with an uneven count of samples per shard: 2 epochs with equal batch counts on
both ranks and no hang; a SIGTERM mid-epoch, then a resume, hands out sample by sample what the
uninterrupted run does (the sample keys each rank saw are recorded)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, offline_env
from tests.image_files import make_folder
from trainkit.config import DataConfig
from trainkit.data.tools.shard_writer import write_shards
from trainkit.data.pipeline import shard_loaders
from trainkit.core.runtime import Runtime

pytestmark = pytest.mark.dist


def torchrun(root: Path, out: Path, *extra: str) -> subprocess.Popen[str]:
    out.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", "--monitor-interval=0.1", "-m", "tests.dist.shards_read",
               str(root), str(out), *extra]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=offline_env(OMP_NUM_THREADS="1"))


def keys(out: Path, rank: int) -> list[tuple[int, list[str]]]:
    lines = (out / f"keys{rank}.jsonl").read_text().splitlines()
    return [(line["epoch"], line["keys"]) for line in map(json.loads, lines)]


def test_two_ranks_two_workers_equal_batches_and_exact_resume_after_sigterm(
        tmp_path: Path) -> None:
    make_folder(tmp_path / "images", classes=3, per_class=7, val_per_class=1, sizes=(12, 16))
    index = write_shards(tmp_path / "images", tmp_path / "shards", 4)
    assert [e["samples"] for e in index["train"]] == [4, 4, 4, 4, 4, 1]  # uneven
    root = tmp_path / "shards"

    # the uninterrupted reading, each rank's loader driven here (a loader needs no process group)
    whole = {rank: uninterrupted(root, rank) for rank in (0, 1)}
    cut = tmp_path / "cut"
    stopped = torchrun(root, cut, "--pause-at", "1", "0")  # after epoch 1's first batch
    paused = [cut / f"paused{r}" for r in (0, 1)]
    deadline = time.monotonic() + 180
    while not all(p.is_file() and p.read_text() for p in paused):  # both ranks mid-epoch
        assert stopped.poll() is None, stopped.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the ranks never reached the pause"
        time.sleep(0.05)
    for p in paused:
        os.kill(int(p.read_text()), signal.SIGTERM)
    out_cut = stopped.communicate(timeout=180)[0]
    assert stopped.returncode != 0, out_cut[-3000:]  # the ranks exited 75
    assert [json.loads((cut / f"state{r}.json").read_text()) for r in (0, 1)] == [
        {"epoch": 1, "batch": 1}] * 2
    resumed = torchrun(root, cut, "--resume")
    out_resumed = resumed.communicate(timeout=180)[0]
    assert resumed.returncode == 0, out_resumed[-3000:]

    # an epoch is 21 // 2 = 10 samples per rank: 3 batches of 3 on each rank, both epochs (the
    # resumed run's ranks agreed on each batch: a rank short of batches would have hung it)
    assert "batches per epoch [[2], [2]]" in out_resumed  # epoch 1's rest
    for rank in (0, 1):
        assert [e for e, _ in whole[rank]] == [0, 0, 0, 1, 1, 1]
        assert all(len(k) == 3 for _, k in whole[rank])
        assert keys(cut, rank) == whole[rank]  # sample by sample, in order
    # the ranks read different samples in an epoch (disjoint shards), epochs differ in order
    for epoch in (0, 1):
        seen = [{k for e, b in whole[r] if e == epoch for k in b} for r in (0, 1)]
        assert not seen[0] & seen[1]
    assert whole[0][0][1] != whole[0][3][1]


def uninterrupted(root: Path, rank: int) -> list[tuple[int, list[str]]]:
    """What rank ``rank`` of 2 reads in 2 epochs, with shards_read's settings."""
    cfg = DataConfig(name="webdataset", root=str(root), batch_size=3, num_workers=2,
                     image_size=8, shuffle_buffer=4)
    runtime = Runtime(torch.device("cpu"), rank=rank, world_size=2)
    loader = shard_loaders(cfg, runtime, seed=5)[0].loader
    read = []
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        read += [(epoch, batch.keys) for batch in loader]
    return read
