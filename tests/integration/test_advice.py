"""The bottleneck line of a real run: said once in train.log for a slow loader, never for a fast
one, kept in summary.json's ``advice``, and off with ``trainer.advice=false``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import offline_env, run_train

pytestmark = [pytest.mark.slow, pytest.mark.serial]

ENV = offline_env(OMP_NUM_THREADS="1")  # as tests/integration/test_probe.py


def run(run_dir: Path, *extra: str, model: str = "TinyNet") -> tuple[list[str], list[str]]:
    """Ten steps logged every two: the train.log lines that give advice, and summary's list."""
    result = run_train("+exp=mnist", f"hydra.run.dir={run_dir}", "trainer.precision=32",
                       "~model.widths", f"model._target_=tests.helpers.probe_parts.{model}",
                       "trainer.max_steps=10", "trainer.log_every_n_steps=2", "data.batch_size=8",
                       "data.eval_batch_size=64", *extra, env=ENV, fork=True)
    assert result.returncode == 0, result.stderr[-3000:]
    log = (run_dir / "train.log").read_text().splitlines()
    summary = json.loads((run_dir / "summary.json").read_text())
    return [line for line in log if "advice: " in line], summary["advice"]


SLOW = ("+dataset._target_=tests.helpers.probe_parts.slow_reader", "data.loader=dataloader",
        "data.num_workers=0")


def test_a_slow_loader_gets_one_line_naming_the_share_and_the_setting(tmp_path: Path) -> None:
    lines, advice = run(tmp_path, *SLOW)
    assert len(lines) == 1, lines  # five windows; said once, after three waiting ones
    text = lines[0].split("advice: ", 1)[1]
    assert text.startswith("input-bound: the step waited for data ")
    assert "data.num_workers=2 (now 0)" in text and "data.loader=memory" in text
    assert advice == [text]


def test_a_fast_loader_gets_none(tmp_path: Path) -> None:
    # fast next to its step: TinyNet's step is as short as the in-memory loader's batch gather,
    # so a loaded machine could tip it over the threshold either way
    lines, advice = run(tmp_path, "+dataset._target_=tests.helpers.probe_parts.fast_reader",
                        model="HeavyNet")
    assert lines == [] and advice == []


def test_advice_off_says_nothing(tmp_path: Path) -> None:
    lines, advice = run(tmp_path, *SLOW, "trainer.advice=false")
    assert lines == [] and advice == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host reads cost only on a GPU")
def test_a_forward_that_reads_the_gpu_every_step_is_named(tmp_path: Path) -> None:
    lines, advice = run(tmp_path, "+dataset._target_=tests.helpers.probe_parts.fast_reader",
                        "model._target_=tests.helpers.probe_parts.ReadingNet",
                        "trainer.device=cuda")
    assert [line.split("advice: ", 1)[1] for line in lines] == advice
    assert len(advice) == 1 and advice[0].startswith("host reads: "), advice
