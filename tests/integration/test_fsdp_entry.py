"""trainer.strategy=fsdp through the real entry point, in one process: a wrong fsdp_blocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import error_report, run_train, tiny_run

pytestmark = pytest.mark.slow


def test_fsdp_blocks_matching_nothing_is_one_line_listing_what_the_model_has(
        tmp_path: Path, mnist_root: Path) -> None:
    run = tmp_path / "run"
    result = run_train(*tiny_run(run, mnist_root, "trainer.strategy=fsdp",
                                 "trainer.fsdp_blocks=[Block,head]"))
    assert result.returncode == 2, result.stderr[-3000:]
    _, line = error_report(result.stderr)
    assert line.startswith("trainkit: trainer.fsdp_blocks: ['Block'] match nothing in MnistNet; "
                           "its paths: features, head; classes: Sequential, "), line
    assert not list(run.glob("checkpoints/*"))  # stopped before training wrote anything
