"""Sharded (FSDP, DCP) checkpoints on S3: 2 ranks through real torchrun (gloo) against moto's S3
server over HTTP.

An uninterrupted run is the reference; a run stopped by SIGTERM, then the same command on a fresh
local folder, resumes from the bucket alone and ends bitwise where the reference did.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from tests.conftest import REPO, hear_preemption_signals, offline_env, pause_at, wait_for_pause
from tests.dist.test_sharded_checkpoints import (
    STEPS,
    assert_same_checkpoint,
    ok,
    overrides,
    torchrun,
)
from tests.dist.test_torchrun import torchrun_command
from tests.helpers.fakes import write_fake_mnist
from tests.helpers.s3 import S3, s3_server
from trainkit.checkpoint.consolidate import load_full

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.fixture(scope="module")
def s3() -> Iterator[S3]:
    with s3_server() as server:
        server.bucket("runs")
        yield server


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fake_mnist(tmp_path_factory.mktemp("fsdps3data"), n_train=256, n_test=64)


def _bucket() -> object:
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.invalidate_cache()
    return fs


def _args(run_dir: Path, data_root: Path, url: str, *extra: str) -> list[str]:
    return overrides(run_dir, data_root, f"checkpoint.dir={url}", "checkpoint.monitor=val/acc",
                     *extra)


def _run(run_dir: Path, data_root: Path, url: str, s3: S3,
         *extra: str) -> subprocess.CompletedProcess[str]:
    return torchrun(*_args(run_dir, data_root, url, *extra), **s3.env)


def _stop_after_step(run_dir: Path, data_root: Path, url: str, s3: S3, step: int) -> int:
    """Start the run, SIGTERM torchrun (which passes it to both ranks) once both ranks wait
    for it at the end of ``step``; returns torchrun's exit status."""
    run_dir.mkdir(parents=True)
    marker = run_dir.parent / "paused{rank}"
    with open(run_dir.parent / "torchrun.out", "wb") as out:
        proc = subprocess.Popen(
            torchrun_command(*_args(run_dir, data_root, url, *pause_at(step, marker))),
            cwd=REPO, env=offline_env(TRAINKIT_DIST_TIMEOUT_S="60", **s3.env), stdout=out,
            stderr=subprocess.STDOUT, preexec_fn=hear_preemption_signals)
    try:
        wait_for_pause(proc, marker, ranks=2)
    finally:
        if proc.poll() is None and not all(
                Path(str(marker).replace("{rank}", str(r))).is_file() for r in (0, 1)):
            proc.kill()
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=120)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, data_root: Path, s3: S3) -> Path:
    """An uninterrupted 2-rank fsdp run saving to the bucket every 2 steps, keeping 2."""
    run = tmp_path_factory.mktemp("straight") / "run"
    ok(_run(run, data_root, "s3://runs/straight", s3))
    return run


def test_the_bucket_keeps_the_newest_committed_checkpoints_whole(straight: Path, s3: S3) -> None:
    fs = _bucket()
    names = sorted(path.rsplit("/", 1)[-1] for path in fs.ls("runs/straight"))
    assert names == ["best.json", "last.json", "objects", "step_000000006.json",
                     "step_000000008.json"]
    records = {name: json.loads(fs.cat(f"runs/straight/{name}")) for name in names
               if name.endswith(".json")}
    assert [records[n]["global_step"] for n in ("last.json", "best.json")] == [STEPS, STEPS]
    # the rotated objects are gone; each record's object holds every rank's part, as named
    objects = {f"objects/{p.rsplit('/', 1)[-1]}" for p in fs.ls("runs/straight/objects")}
    assert objects == {record["object"] for record in records.values()}
    for record in records.values():
        found = {e["name"].rsplit("/", 1)[-1]: e["size"]
                 for e in fs.ls(f"runs/straight/{record['object']}", detail=True)}
        assert found == record["files"]
        assert {".metadata", "__0_0.distcp", "__1_0.distcp", record["meta"]} == set(found)
    meta = load_full("s3://runs/straight/last.json")
    assert meta["trainer"]["best_metric"] is not None and meta["world_size"] == 2
    assert not (straight / "checkpoints").exists()  # nothing written locally


def test_sigterm_then_the_same_command_on_a_fresh_folder_resumes_bitwise_from_the_bucket(
        straight: Path, data_root: Path, s3: S3, tmp_path: Path) -> None:
    url = "s3://runs/stopped"
    assert _stop_after_step(tmp_path / "first", data_root, url, s3, 2) != 0
    stopped_at = json.loads(_bucket().cat("runs/stopped/last.json"))["global_step"]
    assert 2 <= stopped_at < STEPS  # mid-epoch
    assert f"stopped at step {stopped_at}" in (tmp_path / "first" / "train.log").read_text()

    ok(_run(tmp_path / "fresh", data_root, url, s3))  # another machine: an empty local folder
    log = (tmp_path / "fresh" / "train.log").read_text()
    assert f"resumed from {url}/last.json at step {stopped_at} (epoch 1, batch {stopped_at})" in log
    assert_same_checkpoint(load_full(f"{url}/last.json"), load_full("s3://runs/straight/last.json"))



def test_async_sharded_saves_to_a_url_are_refused_in_one_line(tmp_path: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from trainkit.checkpoint.storages import storages_for
    from trainkit.config import CheckpointConfig
    from trainkit.core.errors import ConfigError
    from trainkit.core.runtime import Runtime

    # a real FSDP2 module, in this process: a group of one rank, for this test only
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        model = fully_shard(torch.nn.Linear(2, 2))
        with pytest.raises(ConfigError) as refused:
            storages_for(model, "memory://bucket/run", CheckpointConfig(async_save=True),
                         Runtime(torch.device("cpu")))
    finally:
        dist.destroy_process_group()
    assert str(refused.value) == (
        "checkpoint.dir=memory://bucket/run: a sharded (fsdp) run saves to a URL synchronously "
        "only; set checkpoint.async_save=false or give a path")
