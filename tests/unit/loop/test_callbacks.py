"""Evaluation by steps, a forward's own scalars, callbacks, request_stop and EarlyStopping, in
real one-process fits."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from benchmarks.syncs import fit_reads, gpu_path_on_the_cpu
from tests.conftest import assert_same_weights, last_checkpoint
from trainkit import Callback, CheckpointConfig, EarlyStopping, Trainer, TrainerConfig
from trainkit.core.errors import LINE_LIMIT, TrainkitError
from trainkit.data import InMemoryLoader
from trainkit.data.sources.tensors import TensorData
from trainkit.loop.callbacks import CallbackError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 3))


def _loader() -> InMemoryLoader:  # 12 batches of 8 an epoch, resumable mid-epoch
    g = torch.Generator().manual_seed(3)
    data = TensorData(torch.randint(0, 255, (96, 1, 4, 4), dtype=torch.uint8, generator=g),
                      torch.randint(0, 3, (96,), generator=g), (0.5,), (0.25,), 3)
    return InMemoryLoader(data, 8, shuffle=True, seed=0)


class CountedBatches:
    """Validation batches that count how many were taken."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.batches = [(torch.randn(8, 1, 4, 4, generator=g),
                         torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]
        self.taken = 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.batches:
            self.taken += 1
            yield batch


class Recorder:
    """Every event, in order; stateful (a count of evaluations, under its own key)."""

    state_key = "recorder"

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.evaluations = 0

    def on_fit_start(self, trainer: Trainer) -> None:
        self.events.append(("fit_start", trainer.state.global_step))

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        self.events.append(("step", step))

    def on_evaluation_end(self, trainer: Trainer, results: dict[str, float], step: int) -> None:
        self.evaluations += 1
        self.events.append(("eval", step, results["val/loss"]))

    def on_checkpoint(self, trainer: Trainer, path: Path | None, step: int) -> None:
        self.events.append(("checkpoint", step, path.name if path else None))

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self.events.append(("fit_end", summary["status"]))

    def state_dict(self) -> dict[str, int]:
        return {"evaluations": self.evaluations}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.evaluations = state["evaluations"]

    def steps(self, kind: str) -> list[int]:
        return [e[1] for e in self.events if e[0] == kind]


def _fit(run_dir: Path, recorder: Recorder, val: CountedBatches, stop_at: int | None = None
         ) -> tuple[nn.Module, dict[str, Any]]:
    config = TrainerConfig(device="cpu", max_epochs=2, max_steps=20, eval_every_n_steps=5,
                           eval_max_batches=2, log_every_n_steps=5, log_every_n_seconds=0)
    trainer = Trainer(config, run_dir=run_dir, callbacks=[recorder],
                      checkpoint=CheckpointConfig(every_n_steps=5, monitor="val/loss",
                                                  mode="min"))
    model = _model()
    summary = trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), _loader(),
                          val_data=val, stop_at_step=stop_at)
    return model, summary


def test_evaluations_by_steps_and_epochs_feed_best_and_resume_at_the_same_steps(
        tmp_path: Path) -> None:
    """Every 5 steps and at the end of epoch 1 (step 12), on 2 of 4 batches; best.pt is the
    best of them; a run stopped at step 7 and resumed evaluates at the same steps."""
    whole, val = Recorder(), CountedBatches(4)
    model, summary = _fit(tmp_path / "whole", whole, val)
    assert whole.steps("eval") == [5, 10, 12, 15, 20] and val.taken == 2 * 5
    losses = {e[1]: e[2] for e in whole.events if e[0] == "eval"}
    best_step = min(losses, key=losses.get)
    best = torch.load(tmp_path / "whole" / "checkpoints" / "best.pt", weights_only=True)
    assert best["global_step"] == best_step and best["trainer"]["best_metric"] == losses[best_step]
    # the evaluation of a save's step came first: step 10's checkpoint knows its result
    step_10 = torch.load(tmp_path / "whole" / "checkpoints" / "step_000000010.pt",
                         weights_only=True)
    assert step_10["trainer"]["best_metric"] == min(losses[5], losses[10])
    assert summary["metrics"]["val/loss"] == losses[20]
    lines = [json.loads(s) for s in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert {line["step"]: line["val/loss"] for line in lines if "val/loss" in line} == losses
    # events in order: an evaluation before its step's checkpoint, the best's save first
    assert whole.events[0] == ("fit_start", 0) and whole.events[-1] == ("fit_end", "completed")
    at_10 = [e[0] for e in whole.events if e[1:2] == (10,)]
    assert at_10[:2] == ["step", "eval"] and "checkpoint" in at_10

    first, second = Recorder(), Recorder()
    _, stopped = _fit(tmp_path / "cut", first, CountedBatches(4), stop_at=7)
    assert stopped["status"] == "preempted" and first.steps("eval") == [5]
    resumed_model, _ = _fit(tmp_path / "cut", second, CountedBatches(4))
    assert second.steps("eval") == [10, 12, 15, 20] and second.evaluations == 5  # restored
    assert_same_weights(model.state_dict(), resumed_model.state_dict())
    assert last_checkpoint(tmp_path / "cut")["callbacks"] == {"recorder": {"evaluations": 5}}


def _own_forward(seen: list[float]) -> Any:
    def forward(model: nn.Module, batch: Any) -> tuple[Any, ...]:
        x, y = batch
        aux = x.abs().mean()
        seen.append(aux.item())  # this test's own record; trainkit reads nothing per step
        return model(x), y, {"aux": aux, "tokens": x.shape[0]}
    return forward


def test_own_scalars_are_window_means_in_tensorboard_and_metrics_jsonl(tmp_path: Path) -> None:
    seen: list[float] = []
    config = TrainerConfig(device="cpu", max_steps=6, log_every_n_steps=3, log_every_n_seconds=0)
    model = _model()
    Trainer(config, run_dir=tmp_path).fit(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                          _loader(), forward=_own_forward(seen))
    by_hand = [sum(seen[:3]) / 3, sum(seen[3:6]) / 3]
    lines = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["train/aux"] for line in lines] == pytest.approx(by_hand, rel=1e-6)
    assert [line["train/tokens"] for line in lines] == [8.0, 8.0]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    logged = events.Scalars("train/aux")
    assert [e.step for e in logged] == [3, 6]
    assert [e.value for e in logged] == pytest.approx(by_hand, rel=1e-6)


def test_own_scalars_add_no_host_read_between_logging_steps() -> None:
    def forward(model: nn.Module, batch: Any) -> tuple[Any, ...]:
        x, y = batch
        out = model(x)
        return out, y, {"aux": out.pow(2).mean(), "z": torch.logsumexp(out, -1).mean()}

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 2-core machine shared with other tests: no threads spinning
    try:
        with gpu_path_on_the_cpu():
            short = fit_reads(20, 10, "cpu", forward=forward)
            long_same_logs = fit_reads(40, 20, "cpu", forward=forward)
    finally:
        torch.set_num_threads(threads)
    assert short["host_reads"] == long_same_logs["host_reads"], (short, long_same_logs)


@pytest.mark.parametrize(("own", "words"), [
    ([1.0], "forward's third item is a list, not a mapping"),
    ({"aux": torch.ones(3)}, "forward's scalar 'aux' has shape (3,)"),
    ({"aux": "high"}, "forward's scalar 'aux' is a str"),
    ({"loss": torch.tensor(1.0)}, "would replace trainkit's own train/loss"),
])
def test_a_bad_third_item_is_one_line_naming_it(own: Any, words: str) -> None:
    model = _model()
    with pytest.raises(TrainkitError) as err:
        Trainer(TrainerConfig(device="cpu", max_steps=2)).fit(
            model, torch.optim.SGD(model.parameters(), lr=0.1), _loader(),
            forward=lambda m, b: (m(b[0]), b[1], own))
    assert words in str(err.value) and len(f"trainkit: {err.value}") <= LINE_LIMIT


def test_two_stateful_callbacks_with_one_key_are_an_error() -> None:
    with pytest.raises(TrainkitError, match=r"two callbacks save their state under "
                                            r"'EarlyStopping'.*give one a different state_key"):
        Trainer(TrainerConfig(device="cpu"),
                callbacks=[EarlyStopping("val/loss"), EarlyStopping("val/acc")])
    Trainer(TrainerConfig(device="cpu"),
            callbacks=[EarlyStopping("val/loss"), EarlyStopping("val/acc", state_key="acc")])


class OnlySteps(Callback):
    """Subclasses the protocol and defines one event: the others are not called."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, trainer: Any, step: int) -> None:
        self.steps.append(step)
        if step == 3:
            trainer.request_stop("enough at 3")


def test_request_stop_ends_the_run_with_one_checkpoint_and_a_rerun_trains_no_further(
        tmp_path: Path) -> None:
    model, callback = _model(), OnlySteps()
    trainer = Trainer(TrainerConfig(device="cpu", max_steps=10), run_dir=tmp_path,
                      callbacks=[callback])
    assert list(trainer.callbacks.handlers["on_step_end"]) == [callback.on_step_end]
    assert not trainer.callbacks.handlers["on_fit_start"]
    summary = trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), _loader())
    assert summary["status"] == "stopped" and summary["stop_reason"] == "enough at 3"
    assert callback.steps == [1, 2, 3] and summary["global_step"] == 3
    assert last_checkpoint(tmp_path)["trainer"]["stop_reason"] == "enough at 3"
    assert "stopped at step 3: enough at 3" in (tmp_path / "train.log").read_text()
    again = Trainer(TrainerConfig(device="cpu", max_steps=10), run_dir=tmp_path).fit(
        _model(), torch.optim.SGD(model.parameters(), lr=0.1), _loader())
    assert again["status"] == "stopped" and again["global_step"] == 3
    assert "stopped at step 3 (enough at 3): nothing more to train" in (
        tmp_path / "train.log").read_text()


def test_early_stopping_counts_evaluations_without_improvement() -> None:
    class Stub:
        reason = None

        def request_stop(self, reason: str) -> None:
            self.reason = reason

    stop, trainer = EarlyStopping("val/acc", mode="max", patience=2, min_delta=0.01), Stub()
    for step, acc in enumerate([0.5, 0.6, 0.605, 0.7, 0.7, 0.69]):
        stop.on_evaluation_end(trainer, {"val/acc": acc}, step)
        assert (trainer.reason is None) == (step < 5), step
    assert stop.state_dict() == {"best": 0.7, "bad_evaluations": 2}
    assert "val/acc did not improve on 0.7 for 2 evaluations" in trainer.reason
    fresh = EarlyStopping("val/acc", mode="max", patience=2)
    fresh.load_state_dict(stop.state_dict())
    assert fresh.best == 0.7 and fresh.bad_evaluations == 2
    with pytest.raises(TrainkitError, match=r"monitor='val/acc' is not a result.*val/loss"):
        stop.on_evaluation_end(trainer, {"val/loss": 1.0}, 9)


class Raises:
    def on_evaluation_end(self, trainer: Any, results: Any, step: int) -> None:
        raise KeyError("no such thing")


def test_a_callback_that_raises_ends_the_fit_naming_it_and_the_event(tmp_path: Path) -> None:
    model = _model()
    trainer = Trainer(TrainerConfig(device="cpu", max_steps=4, eval_every_n_steps=2),
                      run_dir=tmp_path, callbacks=[Raises()])
    with pytest.raises(CallbackError) as err:
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), _loader(),
                    val_data=CountedBatches(1), criterion=F.cross_entropy)
    assert str(err.value).startswith("callback Raises raised in on_evaluation_end: KeyError")
    assert len(f"trainkit: {err.value}") <= LINE_LIMIT
    assert "Traceback" in (tmp_path / "train.log").read_text()
    assert not (tmp_path / "checkpoints" / "last.pt").exists()  # none written after it
