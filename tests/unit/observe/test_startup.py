"""startup_s means "process start to first step" only where it is that: the first fit of a
process run from a file or module; a later fit (or a session's) reports its own set-up time."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from tests.conftest import REPO
from trainkit import Trainer, TrainerConfig


def _fit(run_dir: Path) -> dict:
    model = nn.Linear(4, 2)
    data = [(torch.randn(4, 4), torch.randint(0, 2, (4,)))]
    Trainer(TrainerConfig(device="cpu"), run_dir=run_dir).fit(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data)
    return json.loads((run_dir / "summary.json").read_text())


def test_a_later_fit_in_the_process_reports_its_own_set_up(tmp_path: Path) -> None:
    _fit(tmp_path / "first")  # whichever fit of this test process came first
    second = _fit(tmp_path / "second")
    assert second["startup_s"] is None
    assert 0 < second["setup_s"] < second["wall_time_s"] + 60
    log = (tmp_path / "second" / "train.log").read_text()
    assert f"set up in {second['setup_s']:.1f} s" in log and "started in" not in log


def test_a_session_under_ipython_is_not_a_process_start() -> None:
    """IPython loaded (a notebook's kernel, the IPython shell): the process start is the
    session's, not the fit's; a plain ``python -c`` program's first fit keeps it."""
    code = ("import sys, time; {}from trainkit.observe.metrics import startup_seconds as s; "
            "print(s(time.perf_counter())[0] is None)")
    shown = [subprocess.run([sys.executable, "-c", code.format(extra)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
             for extra in ("import IPython; ", "")]
    assert [out.stdout.strip() for out in shown] == ["True", "False"], shown[0].stderr[-2000:]


def test_the_process_start_is_read_to_the_kernels_tick() -> None:
    """A child that sleeps 0.5 s after its imports reports at least that, and no more than the
    parent counted from before starting it (plus one 10 ms tick): a boot time rounded to whole
    seconds would add up to 1 s."""
    code = ("import time; from trainkit.observe.metrics import seconds_since_process_start as s; "
            "time.sleep(0.5); print(s())")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    elapsed = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-2000:]
    assert 0.5 <= float(done.stdout) <= elapsed + 0.01

