"""The Checkpointer's decisions -- which steps save, when it polls an async save, the best --
against a storage that only records what it was asked."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from tests.helpers.storage import RecordingStorage
from trainkit.checkpoint import checkpointer as checkpointer_module
from trainkit.checkpoint.checkpointer import Checkpointer
from trainkit.config import CheckpointConfig
from trainkit.core.runtime import Runtime
from trainkit.loop.precision import Precision
from trainkit.loop.train_state import TrainState


def _checkpointer(storage: RecordingStorage, **config: object) -> Checkpointer:
    runtime = Runtime.from_env("cpu")
    ckpt = Checkpointer(CheckpointConfig(**config), None, runtime)
    model = nn.Linear(2, 2)
    ckpt.register(TrainState(), model=model, optimizer=torch.optim.SGD(model.parameters(), 0.1),
                  precision=Precision("32", runtime.device))
    ckpt.storages = (storage,)
    ckpt.start(planned_steps=100)
    return ckpt


def _run(ckpt: Checkpointer, steps: range, **kwargs: object) -> None:
    for step in steps:
        ckpt.state.global_step = step
        ckpt.step_done(step, **kwargs)


def test_saves_every_n_steps_and_looks_at_no_other_step() -> None:
    storage = RecordingStorage()
    ckpt = _checkpointer(storage, every_n_steps=3)
    _run(ckpt, range(1, 11))
    assert storage.saves == [(3, True, False), (6, True, False), (9, True, False)]
    assert storage.polls == []  # a synchronous save has nothing to publish


def test_no_periodic_saves_unless_asked() -> None:
    storage = RecordingStorage()
    _run(_checkpointer(storage), range(1, 20))
    assert storage.saves == []


def test_an_async_save_is_polled_each_step_until_published_then_no_more() -> None:
    storage = RecordingStorage(polls_to_publish=2)
    ckpt = _checkpointer(storage, every_n_steps=5)
    _run(ckpt, range(1, 11))
    assert storage.saved_steps == [5, 10]
    assert storage.polls == [5, 5]  # steps 6 and 7; 8 and 9 cost one comparison each


def test_a_time_due_save_is_off_the_step_schedule_and_waits_for_the_guard() -> None:
    storage = RecordingStorage()
    ckpt = _checkpointer(storage, every_n_steps=10)
    ckpt.step_done(4, time_due=True)
    ckpt.step_done(7, time_due=True, may_save=lambda: False)  # a NaN/inf streak runs
    assert storage.saved_steps == [4]
    assert storage.polls == [4]  # the step it did not save at polls instead


def test_time_due_counts_from_the_last_save_by_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(checkpointer_module, "time",
                        types.SimpleNamespace(monotonic=lambda: now[0]))
    storage = RecordingStorage()
    ckpt = _checkpointer(storage, every_n_minutes=2)
    now[0] += 119
    assert not ckpt.time_due()
    now[0] += 1
    assert ckpt.time_due()
    ckpt.save(3)
    assert not ckpt.time_due()  # the period starts again at the save
    assert not _checkpointer(RecordingStorage()).time_due()  # not saving by time


def test_one_step_is_saved_once_unless_best_or_again() -> None:
    storage = RecordingStorage()
    ckpt = _checkpointer(storage, every_n_steps=4)
    _run(ckpt, range(1, 5))
    ckpt.save(4, last_step=True)  # the run ends on a step it just saved
    ckpt.save(4, again=True)  # a stop asked since: the state changed
    assert storage.saved_steps == [4, 4]
    ckpt.save(5, last_step=True)
    assert storage.saves[-1] == (5, True, False)
    no_last = RecordingStorage()
    _checkpointer(no_last, save_last=False).save(5, last_step=True)
    assert no_last.saves == []


def test_the_best_is_saved_when_the_monitored_metric_improves() -> None:
    storage = RecordingStorage()
    ckpt = _checkpointer(storage, monitor="val/loss", mode="min", every_n_steps=4)
    for step, loss in [(2, 1.0), (3, 1.5), (4, 0.5)]:
        ckpt.evaluated({"val/loss": loss}, step)
    # step 4 is also a periodic step: saved once, as both
    assert storage.saves == [(2, False, True), (4, True, True)]
    assert ckpt.state.best_metric == 0.5
