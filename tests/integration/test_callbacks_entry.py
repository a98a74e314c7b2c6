"""The entry point's `callbacks` node and evaluation by steps, run for real: early stopping from
the command line, and bad input as one line, exit 2, checkpoints kept."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import error_report, last_checkpoint, run_train, tiny_run

EARLY_STOPPING = ["+callbacks.stop._target_=trainkit.EarlyStopping",
                  "+callbacks.stop.monitor=val/loss"]


def test_early_stopping_from_the_command_line_stops_the_run(tmp_path: Path,
                                                            mnist_root: Path) -> None:
    """Evaluating every 2 steps on 1 batch; min_delta so large that nothing after the first
    evaluation improves: patience 1 stops at step 4, exit 0, the reason in summary and log."""
    run_dir = tmp_path / "run"
    result = run_train(*tiny_run(run_dir, mnist_root, "trainer.max_steps=10",
                                 "trainer.eval_every_n_steps=2", "trainer.eval_max_batches=1",
                                 "checkpoint.monitor=val/loss", "checkpoint.mode=min",
                                 *EARLY_STOPPING, "+callbacks.stop.patience=1",
                                 "+callbacks.stop.min_delta=100"))
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["global_step"] == 4
    assert summary["stop_reason"].startswith("early stopping: val/loss did not improve")
    assert summary["stop_reason"] in (run_dir / "train.log").read_text()
    checkpoint = last_checkpoint(run_dir)
    assert checkpoint["global_step"] == 4
    assert checkpoint["callbacks"]["EarlyStopping"]["bad_evaluations"] == 1
    evaluated = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()
                 if "val/loss" in line]
    assert evaluated == [2, 4]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, mnist_root: Path) -> Path:
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    result = run_train(*tiny_run(run_dir, mnist_root, "trainer.max_steps=2"))
    assert result.returncode == 0, result.stderr[-2000:]
    return run_dir


@pytest.mark.parametrize(("overrides", "words"), [
    (["trainer.eval_max_batches=0"], "trainer.eval_max_batches=0 evaluates nothing"),
    ([*EARLY_STOPPING, "+callbacks.acc._target_=trainkit.EarlyStopping",
      "+callbacks.acc.monitor=val/acc"],
     "two callbacks save their state under 'EarlyStopping' (EarlyStopping and EarlyStopping)"),
    (["+callbacks.boom._target_=tests.helpers.callbacks.Boom"],
     "callback Boom raised in on_step_end: ValueError: boom at step 3"),
], ids=["eval_max_batches=0", "one-key-twice", "raises"])
def test_bad_input_is_one_line_exit_2_and_keeps_the_checkpoint(
        tmp_path: Path, mnist_root: Path, finished: Path, overrides: list[str],
        words: str) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    before = (run_dir / "checkpoints" / "last.pt").read_bytes()
    result = run_train(*tiny_run(run_dir, mnist_root, "trainer.max_steps=4"), *overrides)
    assert result.returncode == 2, result.stderr[-2000:]
    _, last = error_report(result.stderr)
    assert words in last, last
    assert (run_dir / "checkpoints" / "last.pt").read_bytes() == before
    assert json.loads((run_dir / "summary.json").read_text())["global_step"] == 2
    if "Boom" in words:  # the line and the bug's traceback are in train.log too
        log = (run_dir / "train.log").read_text()
        assert last in log and "Traceback" in log and "ValueError: boom at step 3" in log


def test_a_run_that_fails_in_training_is_listed_as_failed_with_its_error(
        tmp_path: Path, mnist_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trainkit.entry.runs import main as runs_main

    run_dir = tmp_path / "runs" / "boom"
    result = run_train(*tiny_run(run_dir, mnist_root, "trainer.max_steps=4",
                                 "+callbacks.boom._target_=tests.helpers.callbacks.Boom"))
    assert result.returncode == 2, result.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary == {"status": "failed", "error": "callback Boom raised in on_step_end: "
                       "ValueError: boom at step 1 (traceback in train.log)"}, summary
    assert runs_main([str(tmp_path / "runs")]) == 0
    row = capsys.readouterr().out.splitlines()[1]
    assert row.split()[:2] == ["boom", "failed"] and row.endswith(summary["error"]), row
