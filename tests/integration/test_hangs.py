"""The hang watchdog through the entry point, one process: a step that never returns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_train, tiny_run
from trainkit.distributed.watchdog import EXIT_HUNG

pytestmark = [pytest.mark.slow, pytest.mark.serial]


def test_a_stuck_step_with_abort_dumps_says_so_and_exits_with_a_hung_summary(
        tmp_path: Path, mnist_root: Path) -> None:
    run = tmp_path / "run"
    # The second training forward sleeps for ten minutes: no step after step 1. The stalled
    # step is the first one under the short limit (a fit's first step has 15 minutes): no
    # ordinary step of a loaded machine can trip it before the stall, only the stall itself.
    proc = run_train(*tiny_run(run, mnist_root, "trainer.max_steps=6",
                               "trainer.hang_timeout_s=2", "trainer.hang_action=abort",
                               "model._target_=tests.dist.nets.FlatNet", "~model.widths",
                               "+model.fault=sleep", "+model.fault_at=2", "+model.fault_rank=0",
                               "+model.sleep_s=600"), timeout=120)
    assert proc.returncode == EXIT_HUNG, proc.stdout[-2000:] + proc.stderr[-2000:]
    stacks = (run / "hangs" / "rank0.txt").read_text()
    assert "rank 0, no step after step 1 for" in stacks
    assert "in _maybe_fail" in stacks and "in forward" in stacks, stacks
    log = (run / "train.log").read_text()
    assert ": rank 0 (last completed step 1, at _maybe_fail (nets.py:" in log, log
    assert f"stack in {run}/hangs/rank0.txt" in log
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "hung" and summary["global_step"] == 1
    assert summary["hang"]["ranks"] == [0] and summary["hang"]["step"] == 1
    assert summary["hang"]["stacks"] == str(run / "hangs" / "rank0.txt")
    assert {"metrics", "epoch", "wall_time_s", "samples_per_s", "world_size"} <= summary.keys()
