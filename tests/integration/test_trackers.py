"""Experiment trackers through the real entry point: MLflow (a local folder store, read back with
``MlflowClient``) and W&B (offline mode), with real signals, resumes and torchrun."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.conftest import (
    REPO,
    Started,
    error_report,
    last_checkpoint,
    offline_env,
    pause_at,
    run_train,
    start_module,
    tiny_run,
    wait_for_pause,
)

# mlflow and wandb are installed by `make test` (the dev extras); imported where used, not at
# collection (~3 s of every worker's start)
if TYPE_CHECKING:
    import mlflow

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not all(map(importlib.util.find_spec, ("mlflow", "wandb"))),
                                 reason="needs mlflow and wandb (the dev extras)")]

# 48 steps (16 an epoch), logged every 2: a run that goes on after its stop at step 6
LONG = ("trainer.max_steps=48",)


def _mlflow(store: Path) -> tuple[str, ...]:
    return ("+sinks.mlflow._target_=trainkit.MLflowSink",
            f"+sinks.mlflow.tracking_uri=file:{store}")


def _client(store: Path, monkeypatch: pytest.MonkeyPatch) -> mlflow.tracking.MlflowClient:
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's opt-in to folder stores
    return mlflow.tracking.MlflowClient(tracking_uri=f"file:{store}")


def _runs(client: mlflow.tracking.MlflowClient) -> list:
    experiment = client.get_experiment_by_name("trainkit")
    return client.search_runs([experiment.experiment_id]) if experiment else []


def _jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _warnings(run_dir: Path, name: str) -> list[str]:
    return [line for line in (run_dir / "train.log").read_text().splitlines()
            if f"metrics sink {name} failed" in line]


def _start(run_dir: Path, mnist_root: Path, *extra: str) -> Started:
    run_dir.mkdir(parents=True, exist_ok=True)
    return start_module("trainkit.train", *tiny_run(run_dir, mnist_root, *extra),
                        out=run_dir.parent / f"{run_dir.name}.out", new_session=True)


def _preempt(run_dir: Path, mnist_root: Path, *extra: str) -> int:
    """Start a run, SIGTERM its whole process group as step 6 (its third logging step) ends, as
    SLURM or systemd would (a tracker's own process must not die before it has sent the run's
    end); the step it stopped at. The run waits at step 6 for the signal: no race to its end."""
    marker = run_dir.parent / f"{run_dir.name}.paused"
    proc = _start(run_dir, mnist_root, *extra, *pause_at(6, marker))
    wait_for_pause(proc, marker)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=120) == 75
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["global_step"] == 6
    return summary["global_step"]


def test_mlflow_keeps_one_run_through_a_sigterm_and_its_resume(
        tmp_path: Path, mnist_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir, store = tmp_path / "run", tmp_path / "mlruns"
    stopped = _preempt(run_dir, mnist_root, *LONG, *_mlflow(store))
    client = _client(store, monkeypatch)
    (first,) = _runs(client)
    assert first.info.status == "KILLED" and first.data.tags["trainkit.status"] == "preempted"
    kept = json.loads((run_dir / "trackers" / "mlflow.json").read_text())
    assert kept["run_id"] == first.info.run_id

    resumed = run_train(*tiny_run(run_dir, mnist_root, *LONG, *_mlflow(store)))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"at step {stopped}" in resumed.stdout
    (run,) = _runs(client)  # the same run, continued
    assert run.info.run_id == first.info.run_id and run.info.status == "FINISHED"
    assert run.data.tags["trainkit.status"] == "completed"
    assert last_checkpoint(run_dir)["manifest"]["trackers"]["mlflow"] == kept
    assert run.data.tags["trainkit.entry.run_dir"] == str(run_dir.resolve())
    assert run.data.params["trainer.max_steps"] == "48"
    assert run.data.params["optim._target_"] == "torch.optim.AdamW"
    assert run.data.params["sinks.mlflow._target_"] == "trainkit.MLflowSink"
    # every metric, step for step, as in metrics.jsonl (no step twice, none missing)
    records = _jsonl(run_dir)
    keys = {key for record in records for key in record} - {"step"}
    assert {"train/loss", "train/lr", "val/acc", "val/loss"} <= keys == set(run.data.metrics)
    for key in keys:
        history = sorted(client.get_metric_history(run.info.run_id, key),
                         key=lambda m: (m.step, m.timestamp))
        expected = [(r["step"], r[key]) for r in records if key in r]
        assert [(m.step, m.value) for m in history] == expected, key
    steps = [r["step"] for r in records if "train/loss" in r]
    assert steps == sorted(set(steps)) and stopped < steps[-1]
    summary = json.loads((run_dir / "summary.json").read_text())
    artifact = Path(run.info.artifact_uri.removeprefix("file://")) / "summary.json"
    assert json.loads(artifact.read_text()) == summary


def test_mlflow_under_torchrun_is_one_run(tmp_path: Path, mnist_root: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir, store = tmp_path / "run", tmp_path / "mlruns"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "--max-restarts=0", "--monitor-interval=0.1", "-m", "trainkit.train",
         *tiny_run(run_dir, mnist_root, "trainer.max_steps=6", *_mlflow(store))],
        cwd=REPO, env=offline_env(TRAINKIT_DIST_TIMEOUT_S="60"), capture_output=True,
        text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    client = _client(store, monkeypatch)
    (run,) = _runs(client)
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == [r["step"] for r in _jsonl(run_dir) if "train/loss" in r]


def test_mlflow_ends_the_run_as_failed_when_training_is_killed(
        tmp_path: Path, mnist_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL (the OOM killer, a scheduler's last word) leaves no time to end the MLflow run:
    the sink's own process sees its input end and ends the run, with what reached it."""
    run_dir, store = tmp_path / "run", tmp_path / "mlruns"
    proc = _start(run_dir, mnist_root, "trainer.max_epochs=100000",
                  "trainer.max_steps=1000000", *_mlflow(store))
    kept, jsonl = run_dir / "trackers" / "mlflow.json", run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (kept.is_file() and jsonl.is_file() and len(jsonl.read_text().splitlines()) >= 3):
        assert proc.poll() is None, f"the run ended (status {proc.returncode}) too early"
        assert time.monotonic() < deadline, "no MLflow run and logging steps in time"
        time.sleep(0.02)
    proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    client = _client(store, monkeypatch)
    run_id = json.loads(kept.read_text())["run_id"]
    while client.get_run(run_id).info.status == "RUNNING":
        assert time.monotonic() < deadline + 60, "the MLflow run was never ended"
        time.sleep(0.1)
    assert client.get_run(run_id).info.status == "FAILED"
    logged = [m.step for m in client.get_metric_history(run_id, "train/loss")]
    written = [r["step"] for r in _jsonl(run_dir) if "train/loss" in r]
    # metrics.jsonl hears each logging step just before MLflow's sink: the kill may fall between
    assert logged and logged in (written, written[:-1])


def _wandb_env(wandb_dir: Path, **extra: str) -> dict[str, str]:
    return offline_env(WANDB_MODE="offline", WANDB_DIR=str(wandb_dir), **extra)


def test_wandb_offline_writes_its_run_and_an_extended_run_keeps_its_id(
        tmp_path: Path, mnist_root: Path) -> None:
    run_dir, wandb_dir = tmp_path / "run", tmp_path / "wb"
    wandb_dir.mkdir()
    sink = ("+sinks.wandb._target_=trainkit.WandbSink", "+sinks.wandb.project=tk-test")
    for steps in (4, 8):  # the same command with more steps: the run goes on
        done = run_train(*tiny_run(run_dir, mnist_root, f"trainer.max_steps={steps}", *sink),
                         env=_wandb_env(wandb_dir))
        assert done.returncode == 0, done.stderr[-2000:]
    run_id = json.loads((run_dir / "trackers" / "wandb.json").read_text())["id"]
    folders = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    assert [f.name.rsplit("-", 1)[1] for f in folders] == [run_id, run_id]
    assert all((f / f"run-{run_id}.wandb").stat().st_size > 0 for f in folders)
    assert last_checkpoint(run_dir)["manifest"]["trackers"]["wandb"]["id"] == run_id
    assert not _warnings(run_dir, "WandbSink")


def test_training_finishes_when_the_wandb_service_cannot_start(
        tmp_path: Path, mnist_root: Path) -> None:
    run_dir, wandb_dir = tmp_path / "run", tmp_path / "wb"
    wandb_dir.mkdir()
    # no time to wait for wandb-core to start: wandb.init raises, as when it cannot start
    done = run_train(*tiny_run(run_dir, mnist_root, "trainer.max_steps=6",
                               "+sinks.wandb._target_=trainkit.WandbSink"),
                     env=_wandb_env(wandb_dir, WANDB__SERVICE_WAIT="0"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    (line,) = _warnings(run_dir, "WandbSink")
    assert "training goes on" in line
    assert [r["step"] for r in _jsonl(run_dir)] == [2, 4, 6, 6]


@pytest.mark.parametrize(("module", "target"), [("mlflow", "trainkit.MLflowSink"),
                                                ("wandb", "trainkit.WandbSink")])
def test_a_tracker_not_installed_is_one_line_naming_the_extra(
        tmp_path: Path, mnist_root: Path, module: str, target: str) -> None:
    # the package made unimportable, as where it is not installed (sys.modules[name] = None)
    code = (f"import sys; sys.modules[{module!r}] = None; sys.argv[0] = 'trainkit.train'; "
            "from trainkit.entry.train import main; main()")
    done = subprocess.run(
        [sys.executable, "-c", code,
         *tiny_run(tmp_path / "run", mnist_root, f"+sinks.x._target_={target}")],
        cwd=REPO, env=offline_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    _, last = error_report(done.stderr)
    assert f'pip install "trainkit[{module}]"' in last
