"""Sharded (FSDP2) checkpoints through real torchrun, 2 processes, gloo on the CPU.

One uninterrupted 2-rank run (sync saves) is the reference. Against it: a run stopped by SIGTERM
and resumed (async saves), bitwise; a run whose rank 1 is SIGKILLed inside the write of a
checkpoint and then resumed in one process with twice the batch, allclose; and the consolidated
file. Faults fire at fixed points (tests/dist/nets.py, and the test-only kill inside the write),
so nothing races.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import REPO, error_report, offline_env, run_train
from tests.dist.nets import FlatNet
from tests.dist.test_torchrun import torchrun_command
from tests.helpers.fakes import write_fake_mnist
from trainkit.checkpoint.consolidate import load_full
from trainkit.checkpoint.sharded import KILL_IN_WRITE_ENV, latest_meta

pytestmark = pytest.mark.dist

STEPS = 8  # one epoch: 256 samples, 2 ranks x batch 16


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fake_mnist(tmp_path_factory.mktemp("fsdpdata"), n_train=256, n_test=64)


def overrides(run_dir: Path, data_root: Path, *extra: str, batch: int = 16) -> list[str]:
    return [
        "+exp=mnist", f"hydra.run.dir={run_dir}", f"data.root={data_root}", "data.verify=false",
        "data.download=false", f"data.batch_size={batch}", "data.eval_batch_size=64",
        "trainer.log_every_n_steps=1", f"trainer.max_steps={STEPS}", "trainer.max_epochs=1",
        "trainer.strategy=fsdp", "trainer.ema_decay=0.9", "checkpoint.every_n_steps=2",
        "checkpoint.keep_last=2", "model._target_=tests.dist.nets.FlatNet", "~model.widths",
        "trainer.precision=32", *extra,
    ]


def torchrun(*args: str, max_restarts: int = 0, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(torchrun_command(*args, max_restarts=max_restarts), cwd=REPO,
                          env=offline_env(TRAINKIT_DIST_TIMEOUT_S="60", **env),
                          capture_output=True, text=True, timeout=240)


def ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def assert_equal_trees(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert_equal_trees(a[key], b[key])
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def assert_same_checkpoint(got: dict, expected: dict) -> None:
    """Two consolidated checkpoints hold the same run state, part by part (per-rank lists too)."""
    for part in ("model", "optimizer", "ema", "rng_per_rank", "trainer", "scheduler"):
        if isinstance(expected[part], list):
            for x, y in zip(got[part], expected[part], strict=True):
                assert_equal_trees(x, y)
        else:
            assert_equal_trees(got[part], expected[part])


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, data_root: Path) -> Path:
    """An uninterrupted 2-rank fsdp run with synchronous saves every 2 steps, keeping 2."""
    run = tmp_path_factory.mktemp("straight") / "run"
    ok(torchrun(*overrides(run, data_root, "checkpoint.monitor=val/acc")))
    return run


def test_a_run_keeps_its_newest_directories_and_points_last_and_best_at_them(
        straight: Path) -> None:
    checkpoints = straight / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "best", "last", "step_000000006", "step_000000008"]
    assert os.readlink(checkpoints / "last") == "step_000000008"
    assert os.readlink(checkpoints / "best") == "step_000000008"  # the one evaluation
    assert sorted(p.name for p in (checkpoints / "last").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "trainkit.pt"]
    meta = torch.load(checkpoints / "last" / "trainkit.pt", weights_only=True)
    assert meta["global_step"] == STEPS and meta["world_size"] == 2
    assert meta["trainer"]["best_metric"] is not None  # rewritten after the evaluation
    assert not torch.equal(meta["rng_per_rank"][0]["torch"], meta["rng_per_rank"][1]["torch"])
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == STEPS


def test_sigterm_then_resume_gives_bitwise_the_uninterrupted_run_with_async_saves(
        straight: Path, data_root: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    # SIGTERM to rank 1 in its 3rd step: both stop after it with exit status 75, and torchrun
    # restarts the group, which resumes from step 3 (the fault fires in the first attempt only).
    ok(torchrun(*overrides(run, data_root, "checkpoint.async_save=true",
                           "checkpoint.monitor=val/acc", "+model.fault=sigterm",
                           "+model.fault_at=3"), max_restarts=1))
    log = (run / "train.log").read_text()
    assert "stopped at step 3" in log and "step_000000003 at step 3 (epoch 1, batch 3)" in log
    for name in ("step_000000006", "step_000000008"):  # async writes what sync writes
        assert sorted(os.listdir(run / "checkpoints" / name)) == sorted(
            os.listdir(straight / "checkpoints" / name))
        assert_same_checkpoint(*(load_full(r / "checkpoints" / name) for r in (run, straight)))


def test_a_rank_killed_mid_write_leaves_the_previous_checkpoint_which_resumes_on_one_process(
        straight: Path, data_root: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    killed = torchrun(*overrides(run, data_root), **{KILL_IN_WRITE_ENV: "4:1"})
    assert killed.returncode != 0
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        ".step_000000004.tmp", "last", "step_000000002"]
    assert os.readlink(checkpoints / "last") == "step_000000002"
    assert not (checkpoints / ".step_000000004.tmp" / ".metadata").exists()
    assert (checkpoints / ".step_000000004.tmp" / "__1_0.distcp").is_file()  # rank 1 wrote

    # One process with twice the batch: the same global batches (FlatNet has no batch-norm), so
    # it continues as the 2 ranks did, from the saved weights and the same sample position.
    single = run_train(*overrides(run, data_root, batch=32))
    assert single.returncode == 0, single.stderr[-3000:]
    log = (run / "train.log").read_text()
    assert "resumed from" in log and "step_000000002 at step 2" in log
    assert "saved on 2 ranks, now 1: the data resumes at sample 64 of the epoch (batch 2)" in log
    assert not (checkpoints / ".step_000000004.tmp").exists()  # the next save cleared it
    got = load_full(checkpoints / "last")
    expected = load_full(straight / "checkpoints" / "last")
    assert got["global_step"] == STEPS and got["world_size"] == 1
    for name, tensor in expected["model"].items():
        torch.testing.assert_close(got["model"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)

    # A plain model (no fsdp) in one process loads a directory of 2 ranks too: DCP fills its
    # full tensors, and the run goes on as the 2 ranks did.
    plain = tmp_path / "plain"
    proc = run_train(*overrides(plain, data_root, "trainer.strategy=auto",
                                f"checkpoint.resume={straight}/checkpoints/step_000000006",
                                batch=32))
    assert proc.returncode == 0, proc.stderr[-3000:]
    weights = torch.load(plain / "checkpoints" / "last.pt", weights_only=True)["model"]
    for name, tensor in expected["model"].items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load, one process
def test_consolidated_file_loads_weights_only_into_the_plain_model(
        straight: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.pt"
    proc = subprocess.run([sys.executable, "-m", "trainkit.checkpoint", "consolidate",
                           str(straight / "checkpoints" / "last"), str(out), "--optimizer"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr  # no runpy warning either
    state = torch.load(out, map_location="cpu", weights_only=True)
    assert state["global_step"] == STEPS
    model = FlatNet()
    model.load_state_dict(state["model"], strict=True)
    # DCP loading straight into the plain model's tensors gives the same weights
    plain = FlatNet().state_dict()
    dcp.load({"model": plain}, checkpoint_id=straight / "checkpoints" / "last", no_dist=True)
    assert_equal_trees(state["model"], plain)
    assert set(state["optimizer"]["state"]) == set(plain)  # keyed by parameter name


@pytest.mark.parametrize("source", ["missing", "run", "incomplete"])
def test_consolidate_refuses_what_is_not_a_complete_checkpoint_in_one_line(
        source: str, straight: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trainkit.checkpoint.__main__ import main  # the command's own code, in this process

    path = {"missing": tmp_path / "nope", "run": straight, "incomplete": tmp_path / "tmp"}[source]
    if source == "incomplete":  # a save that died: shards without .metadata
        path.mkdir()
        (path / "__0_0.distcp").write_bytes(b"x" * 10)
    out = tmp_path / "out.pt"
    assert main(["consolidate", str(path), str(out)]) == 2
    _, last = error_report(capsys.readouterr().err)
    assert str(path) in last
    assert not out.exists() and (source == "missing" or path.exists())


def test_resume_skips_a_broken_newest_directory_with_one_warning(
        straight: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    for name in ("step_000000006", "step_000000008"):
        shutil.copytree(straight / "checkpoints" / name, checkpoints / name)
    os.symlink("step_000000008", checkpoints / "last")
    shard = checkpoints / "step_000000008" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # truncated: the index names bytes beyond it
    (checkpoints / ".step_000000010.tmp").mkdir()  # a save that died: never a candidate
    with caplog.at_level(logging.WARNING, logger="trainkit"):
        meta = latest_meta(checkpoints)
    assert meta is not None and meta["global_step"] == 6
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "step_000000008 is incomplete (__1_0.distcp" in warned[0]
