"""The RunReport: one summary however a fit ends, and the answer to a re-run of an ended run."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers.sinks import RecordingSink
from trainkit.core.runtime import Runtime
from trainkit.loop.run_report import RunReport
from trainkit.loop.train_state import TrainState
from trainkit.observe.metrics import StepMeter
from trainkit.observe.sinks import Sinks
from trainkit.observe.summary import write_summary


@pytest.fixture(autouse=True)
def _trainkit_log_reaches_caplog(monkeypatch: pytest.MonkeyPatch) -> None:
    # an earlier fit in this process (setup_logging) keeps trainkit's lines from the root logger
    monkeypatch.setattr(logging.getLogger("trainkit"), "propagate", True)


def _report(run_dir: Path | None, state: TrainState) -> tuple[RunReport, RecordingSink]:
    runtime = Runtime.from_env("cpu")
    report, sink = RunReport(runtime, run_dir, state), RecordingSink()
    report.open_sinks(Sinks([sink]), {"trainer": {"max_steps": 10}})
    return report, sink


def test_a_finished_run_writes_its_summary_and_tells_the_sinks(tmp_path: Path) -> None:
    state = TrainState(global_step=4, samples_seen=64, epoch=1)
    report, sink = _report(tmp_path, state)
    report.begin(StepMeter(torch.device("cpu")), time.perf_counter(), startup_s=1.5,
                 setup_s=0.25)
    state.global_step, state.samples_seen = 10, 160  # six steps of this process's own
    summary = report.finish("completed", {"val/acc": 0.9}, stop_reason="x")
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert summary["status"] == "completed" and summary["metrics"] == {"val/acc": 0.9}
    assert summary["global_step"] == 10 and summary["startup_s"] == 1.5
    assert summary["setup_s"] == 0.25
    assert summary["stop_reason"] == "x" and summary["advice"] == []
    assert summary["steps_per_s"] > 0  # counted from step 4, where this process began
    assert sink.named("finish") == [("completed", summary)]
    with report:
        pass
    assert sink.named("close") == [None]


def test_running_out_of_memory_before_training_still_writes_a_summary(tmp_path: Path) -> None:
    report, sink = _report(tmp_path, TrainState())
    model = nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    error = report.out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory"), optimizer,
                                 batch=64, accumulate=2, precision="32")
    assert str(error).startswith("out of memory on cpu at step 0 with batch 64")
    assert any("checkpoints are untouched" in line for line in error.details)
    assert model.weight.grad is None  # the failed step's gradients were given back
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "oom"
    assert [status for status, _ in sink.named("finish")] == ["oom"]


def test_a_hung_run_reports_and_closes_its_sinks_before_the_exit(tmp_path: Path) -> None:
    report, sink = _report(tmp_path, TrainState(global_step=3))
    report.abort_hung({"step": 3, "doing": "no step after step 3"})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "hung" and summary["hang"]["step"] == 3
    assert sink.calls[-1] == ("close", None)


@pytest.mark.parametrize(("saved", "ended"), [
    ({"status": "completed", "global_step": 10}, True),
    ({"status": "completed", "global_step": 8}, False),  # another run's summary
    ({"status": "preempted", "global_step": 10}, False),  # stopped at its last step
])
def test_a_rerun_of_a_completed_run_returns_its_summary(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, saved: dict, ended: bool) -> None:
    write_summary(tmp_path, saved)
    report, _ = _report(tmp_path, TrainState(global_step=10, epoch=2))
    with caplog.at_level(logging.INFO, logger="trainkit"):
        got = report.already_ended(total_steps=10, max_epochs=5)
    assert got == (saved if ended else None)
    assert ("the run is complete at step 10 of 10" in caplog.text) == ended


def test_a_run_with_steps_left_has_not_ended(tmp_path: Path) -> None:
    write_summary(tmp_path, {"status": "completed", "global_step": 10})
    report, _ = _report(tmp_path, TrainState(global_step=10, epoch=2))
    assert report.already_ended(total_steps=20, max_epochs=5) is None
    assert _report(tmp_path, TrainState())[0].already_ended(20, 5) is None  # a fresh run


def test_a_rerun_of_a_run_stopped_by_request_says_so(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    saved = {"status": "stopped", "global_step": 4, "stop_reason": "enough"}
    write_summary(tmp_path, saved)
    report, _ = _report(tmp_path, TrainState(global_step=4, stop_reason="enough"))
    with caplog.at_level(logging.INFO, logger="trainkit"):
        assert report.already_ended(total_steps=20, max_epochs=5) == saved
    assert "this run stopped at step 4 (enough): nothing more to train" in caplog.text
