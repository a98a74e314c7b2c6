"""Activation checkpointing through the real entry point: compiled, logged, and a wrong entry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_train, tiny_run

pytestmark = pytest.mark.slow


def test_compiled_run_with_checkpointed_features_trains_and_says_what_it_wrapped(
        tmp_path: Path, mnist_root: Path) -> None:
    # The command: the first compiled step crashed (context_fn refused under compile).
    result = run_train(*tiny_run(tmp_path, mnist_root, "trainer.compile=true",
                                 "trainer.activation_checkpointing=[features]",
                                 "trainer.max_steps=3"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["global_step"] == 3
    log = (tmp_path / "train.log").read_text()
    assert ("activation checkpointing (full: each block's input kept, the rest recomputed in "
            "backward): 1 module: Sequential x1 (features)") in log


def test_an_entry_matching_nothing_lists_what_the_model_has(tmp_path: Path,
                                                            mnist_root: Path) -> None:
    result = run_train(*tiny_run(tmp_path, mnist_root,
                                 "trainer.activation_checkpointing=[Block]"))
    assert result.returncode == 2
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("trainkit: trainer.activation_checkpointing: ['Block'] match nothing "
                           "in MnistNet; its paths: features, head; classes: Sequential, ")
    assert "Traceback" not in result.stderr and len(line) <= 210
