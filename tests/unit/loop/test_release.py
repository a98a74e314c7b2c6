"""What a fit leaves behind: nothing of it holds the user's data or model once they are dropped.

A DataLoader with persistent workers that only the cyclic garbage collector frees waits ~5 s per
worker in its shutdown (torch joins each with a 5 s timeout there), and a model kept alive by a
finished Trainer keeps its memory. Both are checked with the collector off: reference counting
alone must free them, as in a sweep that runs trial after trial in one process.
"""

from __future__ import annotations

import gc
import multiprocessing
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from trainkit import Trainer, TrainerConfig
from trainkit.data import make_loader


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 2, (n,), generator=g))


def _fit(tmp_path: Path, train: object, val: object) -> tuple[Trainer, nn.Module]:
    model = nn.Linear(8, 2)
    trainer = Trainer(TrainerConfig(device="cpu", max_epochs=1, ema_decay=0.9), run_dir=tmp_path)
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), train, val_data=val)
    return trainer, model


def test_after_fit_the_loaders_and_their_workers_go_when_the_user_drops_them(
        tmp_path: Path, no_cyclic_gc: None) -> None:
    before = set(multiprocessing.active_children())
    train = make_loader(_data(), 16, shuffle=True, num_workers=2, persistent_workers=True)
    val = make_loader(_data(), 32, shuffle=False, num_workers=2, persistent_workers=True)
    trainer, _ = _fit(tmp_path, train, val)
    assert len(set(multiprocessing.active_children()) - before) == 4  # persistent: still up
    gone = weakref.ref(train), weakref.ref(val)
    del train, val  # the trainer is still alive: it must not be what keeps them
    assert [ref() for ref in gone] == [None, None]
    assert set(multiprocessing.active_children()) - before == set()
    assert trainer.state.global_step == 4


def test_a_dropped_trainer_frees_its_model_without_the_cyclic_collector(
        tmp_path: Path, no_cyclic_gc: None) -> None:
    data = make_loader(_data(), 16, shuffle=True, num_workers=0)
    trainer, model = _fit(tmp_path, data, data)
    gone = weakref.ref(trainer), weakref.ref(model)
    del trainer, model  # the watchdog's thread outlives every fit: it must hold none of them
    assert [ref() for ref in gone] == [None, None]


def test_a_step_whose_forward_was_wrapped_once_is_freed_without_the_cyclic_collector(
        no_cyclic_gc: None) -> None:
    """The advice's one-off forward wrapper (a GPU run's host-read sampling) leaves no cycle."""
    from trainkit.loop.precision import Precision
    from trainkit.loop.step import WindowStep, default_forward

    model = nn.Linear(8, 2)
    step = WindowStep(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      precision=Precision("32", torch.device("cpu")),
                      criterion=nn.functional.cross_entropy, forward=default_forward,
                      device=torch.device("cpu"))
    step.wrap_forward_once(lambda forward: forward)
    step([(torch.randn(4, 8), torch.randint(0, 2, (4,)))])
    gone = weakref.ref(step), weakref.ref(model)
    del step, model
    assert [ref() for ref in gone] == [None, None]
