"""Evaluation's loss (a torchmetrics MeanMetric over samples) and its schedule."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainkit.loop.evaluation import EvalSchedule, evaluate
from trainkit.loop.precision import Precision
from trainkit.loop.step import default_forward


def _evaluate(model: nn.Module, batches: list) -> dict[str, float]:
    return evaluate(model, batches, precision=Precision("32", torch.device("cpu")),
                    device=torch.device("cpu"), criterion=F.cross_entropy, metrics={},
                    forward=default_forward)


def test_val_loss_is_the_mean_over_samples_not_over_batches() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    batches = [(x[:7], y[:7]), (x[7:], y[7:])]  # unequal: a mean of batch means would differ
    with torch.no_grad():
        want = F.cross_entropy(model(x), y).item()
        batch_means = sum(F.cross_entropy(model(bx), by).item() for bx, by in batches) / 2
    got = _evaluate(model, batches)["val/loss"]
    assert got == pytest.approx(want, rel=1e-6)
    assert abs(got - batch_means) > 1e-4  # the test tells the two apart
    assert model.training  # left as it was


def test_a_nan_batch_makes_the_val_loss_nan_not_left_out() -> None:
    model = nn.Linear(4, 3)
    bad = torch.randn(5, 4)
    bad[0, 0] = float("nan")
    result = _evaluate(model, [(torch.randn(5, 4), torch.zeros(5, dtype=torch.long)),
                               (bad, torch.zeros(5, dtype=torch.long))])
    assert math.isnan(result["val/loss"])


def _due(schedule: EvalSchedule, start: int, epoch: int, end: int) -> list[int]:
    schedule.start_epoch(start, epoch, end)
    return [step for step in range(start + 1, end + 1) if schedule.due(step)]


def test_schedule_evaluates_every_n_steps_each_nth_epoch_end_and_the_last_step() -> None:
    schedule = EvalSchedule(every_n_steps=4, every_n_epochs=2, total_steps=25)
    assert _due(schedule, 0, 0, 10) == [4, 8]  # epoch 1 of 2: no end-of-epoch evaluation
    assert _due(schedule, 10, 1, 20) == [12, 16, 20]  # epoch 2: its end too
    assert _due(schedule, 20, 2, 25) == [24, 25]  # the run's last step


def test_a_resumed_schedule_evaluates_where_the_first_run_would() -> None:
    whole = _due(EvalSchedule(3, 1, 20), 0, 0, 10)
    resumed = _due(EvalSchedule(3, 1, 20), 4, 0, 10)
    assert resumed == [s for s in whole if s > 4] == [6, 9, 10]


def test_no_validation_data_evaluates_never() -> None:
    assert _due(EvalSchedule(2, 1, 10, enabled=False), 0, 0, 10) == []
