"""trainer.spike through the entry point: a dataset of the user's (``dataset._target_``) with a
poisoned sample, rolled back and skipped; the rollback in train.log, metrics.jsonl and
summary.json; a bad setting as one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import error_report, run_train

pytestmark = pytest.mark.slow

# 640 samples, batches of 16: 40 steps; sample 300 lands in step 34's batch (the seed's order)
RUN = ("+exp=mnist", "+dataset._target_=tests.helpers.spikes.PoisonedImages", "data.name=own",
       "data.num_workers=0", "model._target_=tests.helpers.probe_parts.TinyNet",
       "~model.widths", "data.batch_size=16", "trainer.max_epochs=1", "trainer.precision=32",
       "trainer.log_every_n_steps=10", "trainer.spike.warmup=10",
       "trainer.spike.snapshot_every=10")


def _train(run_dir: Path, *extra: str) -> dict:
    result = run_train(*RUN, f"hydra.run.dir={run_dir}", *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


def test_a_poisoned_sample_is_rolled_back_and_counted(tmp_path: Path) -> None:
    clean = _train(tmp_path / "clean", "trainer.spike.enabled=true")
    assert clean["spike_rollbacks"] == 0  # on, and nothing to roll back
    run_dir = tmp_path / "poisoned"
    summary = _train(run_dir, "+dataset.poison=[300]", "trainer.spike.enabled=true")
    assert summary["status"] == "completed" and summary["global_step"] == 40
    assert summary["spike_rollbacks"] == 1 and summary["spike_skipped_batches"] == 4
    # 4 of 40 batches skipped: near the clean run's validation loss, not equal
    assert summary["metrics"]["val/loss"] == pytest.approx(clean["metrics"]["val/loss"],
                                                           rel=0.15)
    lines = [line for line in (run_dir / "train.log").read_text().splitlines()
             if "rolled back" in line]
    assert len(lines) == 1 and "step 34: loss " in lines[0]
    assert "rolled back to step 30, 4 batch(es) skipped" in lines[0]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["spike/rollbacks"]) for r in rows if "spike/rollbacks" in r] == \
        [(34, 1)]


def test_a_setting_out_of_range_is_one_line(tmp_path: Path) -> None:
    result = run_train(*RUN, f"hydra.run.dir={tmp_path / 'run'}", "trainer.spike.enabled=true",
                       "trainer.spike.lr_factor=2")
    assert result.returncode == 2
    _, last = error_report(result.stderr)
    assert last == ("trainkit: trainer.spike.lr_factor must be a number in (0, 1], got 2.0"), \
        result.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()
