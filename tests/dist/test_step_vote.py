"""The StepVote: one object for one process and many; ranks agree in one small all-reduce."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from trainkit.distributed.group import StepVote


def test_one_process_answers_with_its_own_flags_at_every_call() -> None:
    flags = {"stop": False, "save": False}
    vote = StepVote(stop=lambda: flags["stop"], save_due=lambda: flags["save"])
    assert not vote.active
    assert vote.stop_and_save() == (False, False)
    flags["save"] = True
    assert vote.stop_and_save() == (False, True)
    flags["stop"] = True
    assert vote.stop_and_save(again=True) == (True, True)
    assert vote.nonfinite(True) is True and vote.nonfinite(False) is False
    bad = torch.tensor(True)
    assert vote.nonfinite(bad) is bad  # a device flag passes through unread


def test_one_process_without_time_saves_never_saves_by_vote() -> None:
    vote = StepVote(stop=lambda: True, save_due=None)
    assert vote.stop_and_save() == (True, False)


@pytest.mark.dist
def test_two_ranks_agree_on_stop_save_and_nonfinite(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(REPO / "tests" / "helpers" / "vote_worker.py"), str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]  # every rank decided alike
    assert ranks[0] == {
        "active": True,
        "plain": [True, True],  # rank 1's stop, rank 0's save
        "nonfinite": True,  # rank 1's NaN
        "carried": [True, True],
        "nonfinite_tensor": True,  # rank 0's, as a CPU tensor
        "again": [False, True],  # the vote anew sees the stop withdrawn
    }
