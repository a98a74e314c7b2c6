"""examples/own_configs: a user's config folder with its own experiment, model and dataset,
run by the entry point through Hydra's search path, as the README shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, error_report, last_checkpoint, offline_env

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "examples" / "own_configs"


def _train_here(*overrides: str) -> subprocess.CompletedProcess[str]:
    """``python -m trainkit.train`` started in the example's folder, as its user would."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "trainkit.train", "trainer.precision=32",
                           *overrides], cwd=EXAMPLE,
                          env=offline_env(PYTHONPATH=path), capture_output=True, text=True,
                          timeout=300)


def test_own_experiment_trains_its_own_model_on_its_own_dataset(tmp_path: Path) -> None:
    result = _train_here("+exp=mine", "hydra.searchpath=[file://my_configs]",
                         f"hydra.run.dir={tmp_path}", "trainer.max_epochs=1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "training TinyCNN" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 1024 // 64
    assert summary["metrics"]["val/acc"] > 0.5  # four classes: chance is 0.25
    state = last_checkpoint(tmp_path)
    assert "head.weight" in state["model"] and "widths" not in state["config"]["model"]
    assert state["config"]["data"]["name"] == "bars"
    assert state["config"]["dataset"]["_target_"] == "my_project.data.make_bars"


def test_a_key_the_model_does_not_take_says_how_to_drop_it(tmp_path: Path) -> None:
    # trainkit's MNIST model group with the user's class: mnist_net's `widths` stays
    result = _train_here("+exp=mine", "hydra.searchpath=[file://my_configs]", "model=mnist_net",
                         "model._target_=my_project.models.TinyCNN",
                         f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2
    details, last = error_report(result.stderr)
    assert "no argument 'widths'" in last and "~model.widths" in last, last
    assert any("TypeError" in line for line in details), details
