"""Real torchrun, 2 processes, gloo on the CPU: one run, DDP equivalence, signals, restarts.

Run alone with ``pytest -m dist``. Faults are injected by the model itself (tests/dist/nets.py)
at a fixed step of a fixed rank, so no test races a run that may already be over.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torchmetrics.classification import MulticlassAccuracy

from tests.conftest import (
    REPO,
    assert_same_weights,
    last_checkpoint,
    offline_env,
    run_train,
    pause_at,
    start_in_own_group,
    wait_for_pause,
)
from tests.dist.nets import FlatNet
from tests.helpers.fakes import write_fake_mnist
from trainkit import InMemoryLoader, Trainer, TrainerConfig, load_mnist

pytestmark = pytest.mark.dist

STEPS = 6  # short enough that the val accuracy is far from 0 and 1, so a wrong sum would show


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 255 val samples: not divisible by 2 ranks, so one rank has one sample fewer.
    return write_fake_mnist(tmp_path_factory.mktemp("distdata"), n_train=512, n_test=255)


def overrides(outputs: Path, data_root: Path, *extra: str, batch: int = 16,
              run_dir: Path | None = None) -> list[str]:
    """A few-step MNIST-format run of FlatNet into ``outputs/<time with microseconds>`` (or
    into ``run_dir``)."""
    return [
        "+exp=mnist", f"hydra.run.dir={run_dir or f'{outputs}/${{now:%H-%M-%S-%f}}'}",
        f"data.root={data_root}", "data.verify=false", "data.download=false",
        f"data.batch_size={batch}", "data.eval_batch_size=64", "trainer.log_every_n_steps=1",
        f"trainer.max_steps={STEPS}", "checkpoint.every_n_steps=2", "trainer.precision=32",
        "model._target_=tests.dist.nets.FlatNet", "~model.widths", *extra,
    ]


def torchrun_command(*args: str, nproc: int = 2, max_restarts: int = 0,
                     module: str = "trainkit.train") -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
            "--monitor-interval=0.1", "-m", module, *args]


def torchrun(*args: str, nproc: int = 2, max_restarts: int = 0, timeout: float = 240,
             module: str = "trainkit.train") -> subprocess.CompletedProcess[str]:
    """``python -m module *args`` under torchrun (``trainkit.train``, or a test's own script)."""
    command = torchrun_command(*args, nproc=nproc, max_restarts=max_restarts, module=module)
    # A short collective timeout: a hang would fail the test in a minute, not in 30.
    return subprocess.run(command, cwd=REPO, env=offline_env(TRAINKIT_DIST_TIMEOUT_S="60"),
                          capture_output=True, text=True, timeout=timeout)


def only_run_dir(outputs: Path, proc: subprocess.CompletedProcess[str]) -> Path:
    dirs = sorted(p for p in outputs.iterdir()) if outputs.is_dir() else []
    assert len(dirs) == 1, (dirs, proc.stdout[-3000:], proc.stderr[-3000:])
    return dirs[0]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return last_checkpoint(run_dir)["model"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory, data_root: Path) -> Path:
    """An uninterrupted 2-process run: 2 ranks x batch 16."""
    outputs = tmp_path_factory.mktemp("two") / "outputs"
    proc = torchrun(*overrides(outputs, data_root))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return only_run_dir(outputs, proc)


def test_two_ranks_write_one_run_and_train_like_one_process_with_twice_the_batch(
        two_ranks: Path, data_root: Path, tmp_path: Path) -> None:
    run = two_ranks
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["status"] == "completed"
    assert summary["global_step"] == STEPS
    assert (run / ".hydra" / "config.yaml").is_file()  # rank 0's; the others wrote none
    # rank 0 only: one training event file (tb/hparams holds the final hyperparameters), and
    # every event file written by one process (the writer's pid ends the file name)
    events = list(run.rglob("events.out.tfevents.*"))
    assert len([e for e in events if e.parent == run / "tb"]) == 1
    assert len({e.name.rsplit(".", 2)[1] for e in events}) == 1
    assert "global batch 32 = batch 16 x accumulate 1 x world size 2" in (
        run / "train.log").read_text()
    # each rank draws its own random numbers (dropout masks), saved apart for exact resumes
    rng0, rng1 = last_checkpoint(run)["rng_per_rank"]
    assert not torch.equal(rng0["torch"], rng1["torch"])

    single = run_train(*overrides(tmp_path / "outputs", data_root, batch=32))
    assert single.returncode == 0, single.stderr[-3000:]
    expected = weights(only_run_dir(tmp_path / "outputs", single))
    got = weights(run)
    assert got.keys() == expected.keys()
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_val_metrics_cover_the_whole_val_set_once(two_ranks: Path, data_root: Path) -> None:
    """The 2-rank val accuracy is the one a single process gets on the same weights."""
    summary = json.loads((two_ranks / "summary.json").read_text())
    model = FlatNet()
    model.load_state_dict(weights(two_ranks))
    val = InMemoryLoader(load_mnist(data_root, train=False, verify=False, download=False), 64,
                         shuffle=False)
    # the run's criterion, which val/loss uses too (+exp=mnist smooths the labels)
    smoothing = OmegaConf.load(two_ranks / ".hydra" / "config.yaml").loss.label_smoothing
    single = Trainer(TrainerConfig(device="cpu")).evaluate(
        model, val, criterion=functools.partial(F.cross_entropy, label_smoothing=smoothing),
        metrics={"acc": MulticlassAccuracy(10, average="micro")})
    assert 0.0 < single["val/acc"] < 1.0  # else a wrong reduction could go unnoticed
    assert summary["metrics"]["val/acc"] == pytest.approx(single["val/acc"], abs=1e-7)
    assert summary["metrics"]["val/loss"] == pytest.approx(single["val/loss"], rel=1e-5)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_sigterm_to_one_rank_stops_both_at_one_step_with_one_checkpoint(
        data_root: Path, tmp_path: Path, async_save: bool) -> None:
    outputs = tmp_path / "outputs"
    # Rank 1 gets SIGTERM during its 3rd training forward; rank 0 gets no signal.
    proc = torchrun(*overrides(outputs, data_root, "checkpoint.every_n_steps=0",
                               f"checkpoint.async_save={str(async_save).lower()}",
                               "+model.fault=sigterm", "+model.fault_at=3"))
    run = only_run_dir(outputs, proc)
    assert proc.returncode != 0  # torchrun reports workers that exited with status 75
    assert "exitcode  : 75" in proc.stderr, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())  # written by rank 0
    assert summary["status"] == "preempted" and summary["global_step"] == 3
    ckpts = run / "checkpoints"
    assert [p.name for p in ckpts.glob("step_*.pt")] == ["step_000000003.pt"]
    last = last_checkpoint(run)
    assert last["global_step"] == 3 and len(last["rng_per_rank"]) == 2


def test_killed_worker_restarts_the_group_which_resumes_to_the_same_weights(
        two_ranks: Path, data_root: Path, tmp_path: Path) -> None:
    outputs = tmp_path / "outputs"
    # SIGKILL to rank 1 in its 4th forward: the step-2 checkpoint is the newest.
    proc = torchrun(*overrides(outputs, data_root, "+model.fault=sigkill", "+model.fault_at=4"),
                    max_restarts=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = only_run_dir(outputs, proc)  # the restarted group found the first attempt's folder
    log = (run / "train.log").read_text()
    assert "at step 2 (epoch 1, batch 2)" in log, log[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == STEPS
    assert_same_weights(weights(run), weights(two_ranks))


def test_a_failure_on_one_rank_ends_the_job_with_its_one_line_error(
        data_root: Path, tmp_path: Path) -> None:
    outputs = tmp_path / "outputs"
    proc = torchrun(*overrides(outputs, data_root, "+model.fault=error", "+model.fault_at=2"),
                    timeout=120)  # no hang: rank 0 must not wait forever in a collective
    assert proc.returncode != 0
    assert "trainkit: rank 1: injected failure for the test\n" in proc.stderr, proc.stderr[-3000:]
    # The other rank lost its peer mid-collective: one line too, no traceback.
    assert "[rank0]: Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "[rank1]: Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_sigterm_to_the_whole_group_with_workers_stops_every_rank_at_one_step(
        data_root: Path, tmp_path: Path) -> None:
    """``kill -TERM -- -PGID`` of a torchrun job: torchrun, both ranks and their loader workers
    get it, and torchrun forwards its own copy to the ranks. One stop, one checkpoint, and the
    same command resumes to the weights of an uninterrupted run."""
    # one epoch of 16 steps: the signal lands at step 4, where the ranks wait for it
    workers = ("data.loader=dataloader", "data.num_workers=2", "data.random_crop_padding=2",
               "checkpoint.every_n_steps=0", "trainer.max_steps=16")
    straight = torchrun(*overrides(tmp_path / "straight", data_root, *workers))
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    run, marker = tmp_path / "run", tmp_path / "paused{rank}"
    command = torchrun_command(*overrides(tmp_path, data_root, *workers, *pause_at(4, marker),
                                          run_dir=run))
    proc = start_in_own_group(command, tmp_path / "out.txt")
    wait_for_pause(proc, marker, ranks=2)  # both ranks wait at step 4's end for the signal
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=240)
    output = (tmp_path / "out.txt").read_text()
    # torchrun itself ends with its SignalException (docs/distributed.md says what users see)
    assert proc.returncode != 0 and "got signal: 15" in output, output[-3000:]
    assert "killed by signal" not in output and "aborting" not in output, output[-3000:]
    assert output.count("received SIGTERM") == 1, output[-3000:]  # rank 0 alone says it
    summary = json.loads((run / "summary.json").read_text())
    stopped_at = summary["global_step"]
    assert summary["status"] == "preempted" and 0 < stopped_at < 16
    assert output.count(f"stopped at step {stopped_at};") == 1, output[-3000:]
    assert [p.name for p in (run / "checkpoints").glob("step_*.pt")] == [
        f"step_{stopped_at:09d}.pt"]
    assert len(last_checkpoint(run)["rng_per_rank"]) == 2

    resumed = torchrun(*overrides(tmp_path, data_root, *workers, run_dir=run))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"at step {stopped_at} (epoch 1, batch {stopped_at})" in (
        run / "train.log").read_text()
    assert_same_weights(weights(run), weights(only_run_dir(tmp_path / "straight", straight)))
