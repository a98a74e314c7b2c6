"""The hang watchdog under real torchrun, 2 processes, gloo: rank 1's forward stalls at step 2.

Rank 0 then waits in the gradient all-reduce of step 2, so both ranks stop completing steps;
the watchdog must name rank 1, the step it last completed (1), and show where it sleeps.

The stalled step is the only one under the short limit: a fit's first step has 15 minutes, and
step 2 is the run's last (max_steps=2), so no ordinary step slowed by a loaded machine can be
taken for a hang, before the stall or after it (in the restarted attempt, step 2 is again the
fit's first).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist.test_torchrun import only_run_dir, overrides, torchrun
from tests.dist.test_torchrun import data_root  # noqa: F401  (the fixture: same fake files)
from trainkit.distributed.watchdog import EXIT_HUNG

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.serial]

TIMEOUT = "trainer.hang_timeout_s=2"
SLEEP_AT = ["+model.fault=sleep", "+model.fault_at=2"]  # rank 1 (FlatNet's default fault_rank)
LAST = ["trainer.max_steps=2", "checkpoint.every_n_steps=1"]  # the stalled step is the last


def hang_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "hang: no progress" in line]


def test_a_sleeping_rank_is_named_with_its_step_and_stack_and_the_job_goes_on(
        data_root: Path, tmp_path: Path) -> None:
    outputs = tmp_path / "outputs"
    # rank 1 stalls until rank 0 has logged the hang, then goes on (at most 50 s: rank 0's
    # all-reduce gives up at 60, TRAINKIT_DIST_TIMEOUT_S)
    proc = torchrun(*overrides(outputs, data_root, TIMEOUT, *LAST, *SLEEP_AT,
                               "+model.sleep_s=50", f"+model.until_hang_in='{outputs}'"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = only_run_dir(outputs, proc)
    stacks = (run / "hangs" / "rank1.txt").read_text()
    assert "rank 1, no step after step 1 for" in stacks
    assert 'nets.py", line' in stacks and "in _maybe_fail" in stacks, stacks
    log = (run / "train.log").read_text()  # rank 0's
    [line] = hang_lines(log)
    assert "behind: rank 1 (last completed step 1, at _maybe_fail (nets.py:" in line, line
    assert "waiting for it: rank 0 (step 1)" in line, line
    assert f"{run}/hangs/rank<R>.txt" in line
    assert "hang over: training moves again" in log.split(line)[1], log
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 2


def test_abort_ends_the_hung_group_which_torchrun_restarts_from_the_last_checkpoint(
        data_root: Path, tmp_path: Path) -> None:
    outputs = tmp_path / "outputs"
    # Sleeps for ever in the first attempt only (nets.py keys faults on the restart count).
    proc = torchrun(*overrides(outputs, data_root, TIMEOUT, *LAST,
                               "trainer.hang_action=abort", *SLEEP_AT, "+model.sleep_s=600"),
                    max_restarts=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"(exitcode: {EXIT_HUNG})" in proc.stderr, proc.stderr[-3000:]  # the first attempt
    run = only_run_dir(outputs, proc)
    log = (run / "train.log").read_text()
    [line] = hang_lines(log)
    assert "behind: rank 1 (last completed step 1" in line, line
    assert "in _maybe_fail" in (run / "hangs" / "rank1.txt").read_text()  # dumped before exiting
    assert f"hang_action=abort: exiting with status {EXIT_HUNG}" in log
    assert "at step 1 (epoch 1, batch 1)" in log.split(line)[1], log  # resumed from step 1
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 2
