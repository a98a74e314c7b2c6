"""Metric sinks: metrics.jsonl read back, a user's own sink, TensorBoard through its reader."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from trainkit import CheckpointConfig, Trainer, TrainerConfig
from trainkit.observe.sinks import JsonlSink, Sinks


class ListSink:
    """A user's sink: keeps what it is given."""

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.closed = False

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((step, dict(metrics)))

    def close(self) -> None:
        self.closed = True


def _fit(run_dir: Path | None, sinks: list) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g))
               for _ in range(6)]
    trainer = Trainer(TrainerConfig(device="cpu", max_epochs=1, log_every_n_steps=2),
                      run_dir=run_dir, checkpoint=CheckpointConfig(resume=None), sinks=sinks)
    return trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), batches,
                       val_data=batches[:2])


def test_jsonl_and_a_users_sink_get_every_logging_step_and_evaluation(tmp_path: Path) -> None:
    mine = ListSink()
    _fit(tmp_path, [mine])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6, 6]  # three logging steps, one evaluation
    assert all("train/loss" in r for r in records[:3]) and "val/loss" in records[3]
    assert [(step, metrics) for step, metrics in mine.logged] == [
        (r["step"], {k: v for k, v in r.items() if k != "step"}) for r in records]
    assert mine.closed
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(
        [r["train/loss"] for r in records[:3]], rel=1e-6)


def test_a_users_sink_works_without_a_run_dir() -> None:
    mine = ListSink()
    _fit(None, [mine])
    assert [step for step, _ in mine.logged] == [2, 4, 6, 6]


def test_jsonl_appends_and_writes_non_finite_values_as_null(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    for step in (1, 2):
        sink = JsonlSink(path)
        sink.log({"train/loss": float("nan") if step == 2 else 0.5, "amp/skipped_steps": 0}, step)
        sink.close()
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert first == {"step": 1, "train/loss": 0.5, "amp/skipped_steps": 0}
    assert second["train/loss"] is None and not math.isnan(second["step"])


def test_an_object_without_log_is_refused_as_a_sink() -> None:
    with pytest.raises(TypeError, match="log"):
        Sinks([object()])
