"""``trainkit probe`` under real torchrun, 2 processes on gloo: every rank measures (the step
all-reduces, so both must take the same steps), rank 0 alone prints and writes probe.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, offline_env

pytestmark = [pytest.mark.slow, pytest.mark.serial]


def test_two_ranks_measure_and_rank_0_prints(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", "--monitor-interval=0.1", "-m", "trainkit.probe",
               "--seconds", "0.3", "--out", str(out), "+exp=mnist", "trainer.precision=32",
               "+dataset._target_=tests.helpers.probe_parts.fast_reader", "~model.widths",
               "model._target_=tests.helpers.probe_parts.TinyNet", "data.batch_size=8",
               "data.eval_batch_size=64"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240,
                            env=offline_env(OMP_NUM_THREADS="1", TRAINKIT_DIST_TIMEOUT_S="60"))
    assert result.returncode == 0, result.stderr[-3000:]
    stdout = result.stdout.splitlines()
    assert sum(line.startswith("trainkit probe: cpu, 2 process(es)") for line in stdout) == 1
    assert sum(line.startswith("verdict: ") for line in stdout) == 1, result.stdout
    assert sum(line.startswith("together per rank") for line in stdout) == 1
    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and len(report["ranks"]) == 2
    for rank in report["ranks"]:  # each rank's own figures, the same number of steps
        assert [p["name"] for p in rank] == ["loader", "step", "together"]
        assert all(p["samples_per_s"] > 0 for p in rank)
    assert report["ranks"][0][1]["steps"] == report["ranks"][1][1]["steps"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["probe.json"]
