"""``trainkit runs``: a failed run is ``failed`` with its error line, and a run's best
checkpoint (summary.json's ``best``) has its column."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainkit.entry.runs import main as runs_main


def _run(path: Path, lr: str, summary: dict | None) -> None:
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text(f"- optim.lr={lr}\n")
    (path / ".hydra" / "config.yaml").write_text("checkpoint: {monitor: val/acc, mode: max}\n")
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))


def test_failed_runs_say_why_and_best_checkpoints_show(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    best = {"metric": "val/acc", "value": 0.75, "step": 40, "path": "x/checkpoints/best.pt"}
    _run(tmp_path / "a", "0.1", {"status": "completed", "global_step": 60,
                                 "metrics": {"val/acc": 0.5}, "best": best})
    _run(tmp_path / "b", "9", {"status": "failed", "error": "RuntimeError: loss is nan"})
    _run(tmp_path / "c", "0.01", None)
    assert runs_main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["run", "optim.lr", "status", "step", "val/acc", "best", "(step)",
                                "error"]
    assert lines[1].split() == ["a", "0.1", "completed", "60", "0.5", "0.75", "(40)"]
    assert lines[2].split()[:3] == ["b", "9", "failed"]
    assert lines[2].endswith("RuntimeError: loss is nan")
    assert lines[3].split() == ["c", "0.01", "running?"]


def test_csv_has_full_precision_and_one_value_per_column(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 61, fault 12: 0.6046813726425171 is not rounded, and best's step is its own column."""
    import csv
    import io

    best = {"metric": "val/acc", "value": 0.6046813726425171, "step": 40, "path": "x"}
    _run(tmp_path / "a", "0.1", {"status": "completed", "global_step": 60,
                                 "metrics": {"val/acc": 0.5981234567891234, "val/loss": 1.25},
                                 "best": best})
    _run(tmp_path / "b", "0.01", None)
    assert runs_main([str(tmp_path), "--csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert list(rows[0]) == ["run", "optim.lr", "status", "step", "val/acc", "best", "best step",
                             "val/loss"]
    assert rows[0]["val/acc"] == "0.5981234567891234" and rows[0]["val/loss"] == "1.25"
    assert (rows[0]["best"], rows[0]["best step"]) == ("0.6046813726425171", "40")
    assert (rows[1]["best"], rows[1]["best step"], rows[1]["val/acc"]) == ("", "", "")
