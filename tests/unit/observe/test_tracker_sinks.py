"""The sink seam's start/finish/close, a sink that fails, and MLflowSink used from Python."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from trainkit import CheckpointConfig, MLflowSink, Trainer, TrainerConfig, WandbSink
from trainkit.core.errors import ConfigError


class Recorder:
    """A sink with every optional method, keeping what it is told."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def start(self, run_dir: Path | None, config: dict) -> None:
        self.calls.append(("start", run_dir, config))

    def log(self, metrics: dict, step: int) -> None:
        self.calls.append(("log", step))

    def finish(self, status: str, summary: dict) -> None:
        self.calls.append(("finish", status, summary))

    def close(self) -> None:
        self.calls.append(("close",))


class Broken:
    """A tracker whose every call raises, as one whose server is gone."""

    def __init__(self) -> None:
        self.calls = 0

    def _fail(self, *args: object) -> None:
        self.calls += 1
        raise ConnectionError("tracking server unreachable")

    start = log = finish = close = _fail


def _fit(run_dir: Path | None, sinks: list, *, batches: int = 6, epochs: int = 1,
         checkpoint: CheckpointConfig | None = None) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(batches)]
    t = Trainer(TrainerConfig(device="cpu", max_epochs=epochs, log_every_n_steps=2),
                run_dir=run_dir, checkpoint=checkpoint or CheckpointConfig(resume=None),
                sinks=sinks)
    return t.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), data, val_data=data[:2])


def test_a_sink_hears_the_start_every_log_the_finish_and_the_close(tmp_path: Path) -> None:
    sink = Recorder()
    summary = _fit(tmp_path, [sink])
    (_, run_dir, config), *logs, (_, status, told), close = sink.calls
    assert run_dir == tmp_path and config["log_every_n_steps"] == 2  # the trainer's settings
    assert logs == [("log", 2), ("log", 4), ("log", 6), ("log", 6)]
    assert status == "completed" and told == summary
    assert close == ("close",)


def test_a_sink_that_raises_on_every_call_costs_one_warning_line(tmp_path: Path) -> None:
    broken = Broken()
    summary = _fit(tmp_path, [broken])
    assert summary["status"] == "completed"
    assert broken.calls == 2  # start failed: no log or finish after it; close, to free it
    warnings = [line for line in (tmp_path / "train.log").read_text().splitlines()
                if "Broken" in line]
    assert len(warnings) == 1
    assert "metrics sink Broken failed" in warnings[0] and "unreachable" in warnings[0]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6, 6]


def test_a_missing_tracker_library_is_one_line_naming_the_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name, sink in (("mlflow", MLflowSink), ("wandb", WandbSink)):
        monkeypatch.setitem(sys.modules, name, None)  # unimportable, as when not installed
        with pytest.raises(ConfigError, match=rf'pip install "trainkit\[{name}\]"'):
            sink()


def test_importing_trainkit_imports_no_tracker() -> None:
    import subprocess

    code = "import sys, trainkit; print(any(m in sys.modules for m in ('mlflow', 'wandb')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_mlflow_logs_a_replayed_step_once(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file:{tmp_path / 'mlruns'}"
    run_dir = tmp_path / "run"
    # 3 epochs of 2 steps, a checkpoint and an evaluation at each epoch's end
    every_2 = {"batches": 2, "epochs": 3, "checkpoint": CheckpointConfig(every_n_steps=2)}
    _fit(run_dir, [MLflowSink(uri, run_name="demo")], **every_2)
    # as if the run had died after step 6 with its last checkpoint at step 4: resumed there,
    # steps 5 and 6 run (and are logged) again
    checkpoints = run_dir / "checkpoints"
    for name in ("last.pt", "step_000000006.pt"):
        (checkpoints / name).unlink()
    _fit(run_dir, [MLflowSink(uri, run_name="demo")], **every_2)
    client = mlflow.tracking.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("trainkit").experiment_id])
    assert run.info.run_name == "demo" and run.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == [2, 4, 6]  # metrics.jsonl has 6 twice
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/loss")] == [2, 4, 6]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [2, 2, 4, 4, 6, 6, 6, 6]


def test_mlflow_with_its_server_unreachable_costs_one_warning_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    # the sink's process inherits these: one quick try, instead of MLflow's minutes of retries
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    sink = MLflowSink("http://127.0.0.1:9")  # the discard port: nothing listens
    summary = _fit(tmp_path, [sink])
    assert summary["status"] == "completed" and sink.run_id is None
    warnings = [line for line in (tmp_path / "train.log").read_text().splitlines()
                if "MLflowSink" in line]
    assert len(warnings) == 1 and "metrics sink MLflowSink failed" in warnings[0]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6, 6]


def test_one_mlflow_sink_serves_two_fits_fed_by_a_dataloader_with_persistent_workers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's DataLoader: its workers, forked while the sink's process runs, hold that process's
    input open for as long as they live; the sink's close must end the MLflow run anyway. The
    same sink then serves a second fit in this process: a second MLflow run."""
    mlflow = pytest.importorskip("mlflow")
    from torch.utils.data import DataLoader, TensorDataset

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file:{tmp_path / 'mlruns'}"
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(48, 4, generator=g),
                                    torch.randint(0, 3, (48,), generator=g)),
                      batch_size=8, num_workers=2, persistent_workers=True)
    sink = MLflowSink(uri)
    for name in ("first", "second"):
        model = nn.Sequential(nn.Linear(4, 3))
        trainer = Trainer(TrainerConfig(device="cpu", max_epochs=1, log_every_n_steps=2),
                          run_dir=tmp_path / name, checkpoint=CheckpointConfig(resume=None),
                          sinks=[sink])
        assert trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1),
                           data)["status"] == "completed"
        assert "MLflowSink" not in (tmp_path / name / "train.log").read_text()
    client = mlflow.tracking.MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("trainkit").experiment_id])
    assert sorted(run.info.run_name for run in runs) == ["first", "second"]
    for run in runs:
        assert run.info.status == "FINISHED"
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
        assert steps == [2, 4, 6]
