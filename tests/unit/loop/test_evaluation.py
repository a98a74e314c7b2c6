"""Evaluation's loss (a torchmetrics MeanMetric over samples) and its schedule."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainkit import Trainer, TrainerConfig
from trainkit.loop.evaluation import EvalSchedule, LossWatch, evaluate
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


def test_a_diverging_validation_loss_is_said_once_with_its_likely_cause(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Too high a learning rate (another data's recipe): val/loss a thousand times its first
    value is one line naming the learning rate and the recipe, said once; so is NaN."""
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)) for _ in range(4)]
    trainer = Trainer(TrainerConfig(device="cpu", max_steps=5, eval_every_n_steps=1,
                                    log_every_n_steps=5), run_dir=None)
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=1.0), data, val_data=data,
                criterion=F.mse_loss)
    printed = capsys.readouterr()
    said = [line.split(" ", 1)[1] for line in (printed.out + printed.err).splitlines()
            if "diverging" in line]  # after the time
    assert len(said) == 1, said
    assert re.fullmatch(r"val/loss \S+ is over 1000x its first value \(\S+\) at step \d: the run "
                        r"is diverging, most likely a learning rate too high for this model and "
                        r"data \(lower optim.lr\) or another dataset's recipe \(own images: start "
                        r"from \+exp=folder\)", said[0]), said[0]
    watch = LossWatch()
    assert watch.check({"val/loss": 2.3}, 10) is None
    assert watch.check({"val/loss": 2000.0}, 20) is None  # under 1000x: said nothing
    assert watch.check({"val/loss": float("nan")}, 30).startswith("val/loss is nan at step 30:")
    assert watch.check({"val/loss": float("nan")}, 40) is None  # once
