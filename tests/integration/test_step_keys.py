"""The step-mechanics keys through the Hydra entry point: precision, accumulation, clipping, EMA,
activation checkpointing and torch.compile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import assert_same_weights, last_checkpoint, run_train, tiny_run

pytestmark = pytest.mark.slow

STEP_KEYS = ("trainer.precision=bf16-mixed", "trainer.accumulate_grad_batches=3",
             "trainer.gradient_clip_val=0.5", "trainer.ema_decay=0.9", "trainer.max_steps=4")


def test_step_keys_reach_the_step_and_checkpointing_changes_no_number(
        tmp_path: Path, mnist_root: Path) -> None:
    plain, wrapped = tmp_path / "plain", tmp_path / "wrapped"
    first = run_train(*tiny_run(plain, mnist_root, *STEP_KEYS))
    assert first.returncode == 0, first.stderr[-2000:]
    second = run_train(*tiny_run(wrapped, mnist_root, *STEP_KEYS,
                                 "trainer.activation_checkpointing=[features]"))
    assert second.returncode == 0, second.stderr[-2000:]
    assert "global batch 96 = batch 32 x accumulate 3" in first.stdout
    summary = json.loads((plain / "summary.json").read_text())
    assert summary["global_step"] == 4 and summary["skipped_steps"] == 0
    a, b = last_checkpoint(plain), last_checkpoint(wrapped)
    assert a["precision"]["mode"] == "bf16-mixed" and a["ema"]["updates"] == 4
    assert a["trainer"]["batch_in_epoch"] == 12  # 4 windows of 3 batches
    # recomputing the features block in backward changes no weight and no batch-norm statistic
    assert_same_weights(a["model"], b["model"])


def test_compiled_and_eager_runs_agree_and_save_the_same_keys(
        tmp_path: Path, mnist_root: Path) -> None:
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    common = ("trainer.max_steps=3", "sched=constant")
    assert run_train(*tiny_run(eager, mnist_root, *common)).returncode == 0
    result = run_train(*tiny_run(compiled, mnist_root, *common, "trainer.compile=true"),
                       timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    a, b = last_checkpoint(eager)["model"], last_checkpoint(compiled)["model"]
    assert a.keys() == b.keys()  # no "_orig_mod." prefixes
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-3, atol=1e-4)
    loss_a = json.loads((eager / "summary.json").read_text())["metrics"]["val/loss"]
    loss_b = json.loads((compiled / "summary.json").read_text())["metrics"]["val/loss"]
    assert loss_b == pytest.approx(loss_a, rel=1e-3)
