"""torchrun with ``trainer.device=cpu`` (docs/distributed.md's recipe): the ranks join the process
group only once the config names the device, so the backend is gloo even on a GPU machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist.test_torchrun import data_root, only_run_dir, overrides, torchrun

pytestmark = pytest.mark.dist
__all__ = ["data_root"]  # the fixture, imported for this module's tests


def test_two_cpu_ranks_join_with_the_device_the_config_names(data_root: Path,
                                                             tmp_path: Path) -> None:
    outputs = tmp_path / "outputs"
    proc = torchrun(*overrides(outputs, data_root, "trainer.device=cpu", "trainer.max_steps=2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = only_run_dir(outputs, proc)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["status"] == "completed"
    assert " on cpu for 2 steps" in (run / "train.log").read_text()
