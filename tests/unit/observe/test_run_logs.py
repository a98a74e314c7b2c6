"""Several fits in one process (a notebook, an in-process sweep): each writes only its own log."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from trainkit import CheckpointConfig, Trainer, TrainerConfig
from trainkit.observe.logging import LOGGER_NAME, bar_kind


def _fit(run_dir: Path | None) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(3)]
    trainer = Trainer(TrainerConfig(device="cpu", log_every_n_steps=1), run_dir=run_dir,
                      checkpoint=CheckpointConfig(resume=None, save_last=False))
    return trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), data)


def _starts(log: Path) -> int:
    """How many fits wrote their first line into ``log``."""
    return log.read_text().count("training Linear on cpu")


def test_each_fit_writes_only_its_own_train_log(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # where a stray relative train.log would land
    a, b = tmp_path / "a", tmp_path / "b"
    trainer_b = Trainer(TrainerConfig(device="cpu"), run_dir=b)  # built before a's fit runs
    _fit(a)
    assert _starts(a / "train.log") == 1
    _fit(None)  # the notebook's next cell, without a run dir
    assert _starts(a / "train.log") == 1, "run_dir=None appended to the previous run's log"
    _fit(a)  # the cell re-run: its lines once more, each once
    assert _starts(a / "train.log") == 2
    assert (a / "train.log").read_text().count("step 1/3") == 2
    del trainer_b
    _fit(b)
    assert _starts(b / "train.log") == 1 and _starts(a / "train.log") == 2
    assert sorted(p.name for p in tmp_path.rglob("train.log")) == ["train.log", "train.log"]


def test_a_fit_without_run_dir_logs_to_the_console_only(tmp_path: Path, capsys) -> None:
    _fit(tmp_path / "first")
    _fit(None)
    handlers = logging.getLogger(LOGGER_NAME).handlers
    assert not [h for h in handlers if isinstance(h, logging.FileHandler)]
    assert capsys.readouterr().out.count("training Linear on cpu") == 2  # both fits, once each


@pytest.mark.parametrize(("enabled", "expected"), [(False, None), (True, "terminal")])
def test_outside_a_kernel_the_bar_follows_the_request(enabled: bool, expected: str) -> None:
    # Not in a kernel (those: tests/integration/test_notebook.py): a bar when asked for, and
    # otherwise exactly when stdout is a terminal.
    assert bar_kind(enabled) == expected
    assert bar_kind(None) == ("terminal" if sys.stdout.isatty() else None)
