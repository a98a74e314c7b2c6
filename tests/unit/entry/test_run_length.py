"""``trainer.max_steps`` alone is the run's length, and where a limit or the schedule's warm-up
changes what was asked for, one line says so."""

from __future__ import annotations

import torch
from torch import nn

from trainkit import Trainer, TrainerConfig
from trainkit.loop.run_length import length_notes


def test_max_steps_alone_trains_that_many_steps_over_several_epochs() -> None:
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g))
            for _ in range(4)]
    model = nn.Linear(8, 2)
    trainer = Trainer(TrainerConfig(device="cpu", max_steps=10, log_every_n_steps=5))
    summary = trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), data)
    assert (summary["global_step"], summary["epoch"]) == (10, 3)
    assert TrainerConfig().epoch_limit == 1  # neither limit: one epoch, as before


def test_a_limit_that_cuts_the_other_short_is_said_in_one_line() -> None:
    # +exp=mnist's max_epochs: 1 with trainer.max_steps=30, 6 batches an epoch
    assert length_notes(TrainerConfig(max_epochs=1, max_steps=30), 6, None) == [
        "trainer.max_epochs=1 ends the run after 6 steps (6 an epoch), before "
        "trainer.max_steps=30: set trainer.max_epochs=null to let max_steps alone decide"]
    assert length_notes(TrainerConfig(max_epochs=5, max_steps=8), 6, None) == [
        "trainer.max_steps=8 ends the run in epoch 2 of trainer.max_epochs=5 (6 steps an "
        "epoch): set trainer.max_steps=-1 to let max_epochs decide"]
    # max_steps inside the last epoch (+exp=mnist: 188 steps, 0.8 of its one epoch): quiet
    assert length_notes(TrainerConfig(max_epochs=1, max_steps=188), 235, None) == []
    assert length_notes(TrainerConfig(max_steps=30), 6, None) == []


def test_a_warmup_longer_than_the_run_is_said() -> None:
    # +exp=lm (warmup_steps: 100) with trainer.max_steps=60
    sched = {"_target_": "trainkit.core.schedules.warmup_cosine", "warmup_steps": 100}
    assert length_notes(TrainerConfig(max_steps=60), 1000, sched) == [
        "sched.warmup_steps=100 does not fit the run's 60 steps: the learning rate is still "
        "warming up when the run ends; lower sched.warmup_steps"]
    assert length_notes(TrainerConfig(max_steps=600), 1000, sched) == []
