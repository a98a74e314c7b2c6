"""trainer.strategy=fsdp through the real entry point, in one process: the experiments, a wrong
fsdp_blocks."""

from __future__ import annotations

import json
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


@pytest.mark.parametrize("exp", ["mnist", "cifar"])
def test_each_experiment_trains_and_resumes_under_fsdp_with_its_channels_last_in_bf16(
        exp: str, tmp_path: Path, mnist_root: Path, cifar_root: Path) -> None:
    """A user's first FSDP run, `+exp=<exp> trainer.strategy=fsdp`: the experiment's
    channels_last (which fully_shard would refuse on the weights) and bf16-mixed on its
    batch-norm net, in one process; it trains, says where channels_last went, and resumes."""
    run = tmp_path / "run"
    root, widths = ((mnist_root, "[4,8,16]") if exp == "mnist" else (cifar_root, "[4,8,8,8]"))
    args = [f"+exp={exp}", f"hydra.run.dir={run}", f"data.root={root}", "data.verify=false",
            "data.download=false", "data.batch_size=64", "data.eval_batch_size=128",
            f"model.widths={widths}", "trainer.strategy=fsdp", "trainer.precision=bf16-mixed",
            "trainer.log_every_n_steps=1", "trainer.max_epochs=1"]
    first = run_train(*args, "trainer.max_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    log = (run / "train.log").read_text()
    assert log.count("channels_last: the inputs only (fully_shard takes contiguous weights") == 1
    assert "norm layers with running statistics kept in float32" in log
    again = run_train(*args, "trainer.max_steps=3")  # resumes from step 2's sharded checkpoint
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 3
    assert "val/loss" in summary["metrics"]
    assert "resumed from" in (run / "train.log").read_text()
