"""Loss-spike rollback (trainer.spike): the detector, and fits through the library Trainer on a
stream with a known poisoned batch (tests/helpers/spikes.py)."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.conftest import assert_same_weights, last_checkpoint, preemption_signals_heard
from tests.helpers.spikes import ListLoader, batches, net
from trainkit import CheckpointConfig, Trainer, TrainerConfig
from trainkit.config import SpikeConfig
from trainkit.core.errors import ConfigError
from trainkit.loop import spike
from trainkit.loop.spike import LossSpikeError, SpikeDetector

POISON = 35  # the batch (0-based) whose inputs are scaled by 1000: step 36
SPIKE = {"enabled": True, "warmup": 10, "window": 20, "snapshot_every": 10}


# -- the detector ---------------------------------------------------------------------------

def test_the_detector_arms_after_warmup_and_flags_a_loss_above_mean_plus_k_std() -> None:
    detector = SpikeDetector(SpikeConfig(window=4, warmup=3, threshold=3.0))
    assert [detector.observe(x) for x in (5.0, 100.0, 1.0)] == [None] * 3  # not armed yet
    assert detector.state["losses"] == [5.0, 100.0, 1.0]
    for x in (1.0, 1.0, 1.0, 1.0):  # the window keeps the last 4: the warm-up's are gone
        assert detector.observe(x) is None
    assert detector.state["losses"] == [1.0] * 4
    # std floored at a thousandth of the mean: 1 + 3 * 0.001 is the bound
    assert detector.observe(1.002) is None
    why = detector.observe(1.5)
    assert why is not None and why.startswith("loss 1.5 above mean")
    assert detector.state["losses"][-1] == 1.002  # a spike does not join the window


def test_the_detector_counts_non_finite_losses_in_a_row_and_a_finite_one_ends_the_streak() -> None:
    detector = SpikeDetector(SpikeConfig(warmup=100, max_nonfinite=2))
    assert detector.observe(float("nan")) is None
    assert detector.observe(1.0) is None  # the streak ends
    assert detector.observe(float("inf")) is None
    assert detector.observe(float("nan")) == "loss nan for 2 steps in a row"
    assert detector.state["losses"] == [1.0] and detector.state["seen"] == 1
    off = SpikeDetector(SpikeConfig(warmup=100, max_nonfinite=0))
    assert all(off.observe(math.nan) is None for _ in range(10))


@pytest.mark.parametrize(("settings", "words"), [
    ({"window": 1}, "trainer.spike.window must be >= 2"),
    ({"threshold": 0}, "trainer.spike.threshold must be a number in (0, inf]"),
    ({"lr_factor": 1.5}, "trainer.spike.lr_factor must be a number in (0, 1]"),
    ({"snapshot_every": 0}, "trainer.spike.snapshot_every must be >= 1"),
    ({"enabled": "yes"}, "trainer.spike.enabled must be true or false"),
])
def test_out_of_range_settings_are_one_line_errors(settings: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=None) as err:
        TrainerConfig(spike=settings)
    assert str(err.value).startswith(words)


def test_a_non_finite_streak_that_patience_would_stop_first_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"max_nonfinite=4 must be at most trainer\."
                                          r"nonfinite_patience - 2 = 3"):
        TrainerConfig(nonfinite_patience=5, spike={"enabled": True, "max_nonfinite": 4})
    TrainerConfig(nonfinite_patience=5, spike={"enabled": False, "max_nonfinite": 4})  # off


# -- fits -----------------------------------------------------------------------------------

def fit(run_dir: Path | None = None, *, poison: tuple[int, ...] = (POISON,), spike: Any = True,
        callbacks: tuple[Any, ...] = (), forward: Any = None, nan: tuple[int, ...] = (),
        trainer: dict[str, Any] | None = None, plain: bool = False, stop_at_step: int | None = None,
        **checkpoint: Any) -> tuple[dict[str, Any], torch.nn.Module]:
    """60 batches of SGD with momentum and a one-cycle schedule over the poisoned stream, an
    EMA; ``trainer``: more TrainerConfig settings; ``plain``: the batches from a plain
    ``torch.utils.data.DataLoader`` (in the same order)."""
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    epochs = (trainer or {}).get("max_epochs") or 1
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.05, total_steps=60 * epochs)
    settings = {**SPIKE, **spike} if isinstance(spike, dict) else {**SPIKE, "enabled": spike}
    config = TrainerConfig(device="cpu", log_every_n_steps=10, log_every_n_seconds=0,
                           ema_decay=0.9, spike=settings, **(trainer or {}))
    extra = {"forward": forward} if forward is not None else {}
    stream = batches(60, poison, nan=nan)
    if plain:
        inputs, targets = zip(*stream)
        samples = TensorDataset(torch.cat(inputs), torch.cat(targets))
        data: Any = DataLoader(samples, batch_size=8)
    else:
        data = ListLoader(stream)
    summary = Trainer(config, run_dir=run_dir, checkpoint=CheckpointConfig(**checkpoint),
                      callbacks=callbacks).fit(
        model, optimizer, data, scheduler=scheduler, val_data=batches(8, split=1),
        stop_at_step=stop_at_step, **extra)
    return summary, model


@pytest.fixture(scope="module")
def clean() -> dict[str, Any]:
    return fit(poison=(), spike=False)[0]


@pytest.fixture(scope="module")
def rolled(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Any, Path]:
    run_dir = tmp_path_factory.mktemp("rolled")
    summary, model = fit(run_dir, every_n_steps=10)
    return summary, model, run_dir


def test_a_poisoned_batch_is_rolled_back_and_the_run_ends_near_the_clean_one(
        clean: dict[str, Any], rolled: tuple[dict[str, Any], Any, Path]) -> None:
    """The clean run is the same stream with batch 35 as it was before it was scaled; the
    rollback skips it and the 5 batches since the snapshot (step 30), so the run trains on 54
    of the 60 batches: its validation loss is near the clean run's, not equal."""
    summary, _, run_dir = rolled
    assert summary["status"] == "completed" and summary["global_step"] == 60
    assert summary["spike_rollbacks"] == 1 and summary["spike_skipped_batches"] == 6
    assert summary["skipped_steps"] == 6  # the steps undone: 31 to 36
    assert summary["metrics"]["val/loss"] == pytest.approx(clean["metrics"]["val/loss"],
                                                           rel=0.1)
    unguarded = fit(spike=False)[0]  # the same poison, no rollback: the run is wrecked
    assert unguarded["metrics"]["val/loss"] > 100 * clean["metrics"]["val/loss"]
    lines = [line for line in (run_dir / "train.log").read_text().splitlines()
             if "rolled back" in line]
    assert len(lines) == 1
    assert "step 36: loss " in lines[0] and "rolled back to step 30, 6 batch(es) skipped " \
        "(epoch 1 batch 30 to epoch 1 batch 36)" in lines[0]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    spikes = [row for row in rows if "spike/rollbacks" in row]
    assert len(spikes) == 1 and spikes[0]["step"] == 36 and spikes[0]["spike/to_step"] == 30
    assert spikes[0]["spike/skipped_batches"] == 6 and spikes[0]["spike/loss"] > 100
    record = last_checkpoint(run_dir)["trainer"]["spike"]["rollbacks"]
    assert [(r["step"], r["to_step"], r["skipped"]) for r in record] == [(36, 30, [0, 30, 0, 36])]


def test_the_same_run_twice_gives_the_same_weights(
        rolled: tuple[dict[str, Any], Any, Path]) -> None:
    _, again = fit()
    assert_same_weights(again.state_dict(), rolled[1].state_dict())


class _SigtermAt:
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer: Any, step: int) -> None:
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, at a known step


@pytest.mark.parametrize("stop_at", [45, 20], ids=["after-the-rollback", "before-the-spike"])
def test_a_sigterm_then_a_resume_ends_with_the_uninterrupted_weights(
        tmp_path: Path, rolled: tuple[dict[str, Any], Any, Path], stop_at: int) -> None:
    """After the rollback (its record, the detector's window and the state undone are in the
    checkpoint), and before the spike at a snapshot step: the resumed run meets the same spike
    and rolls back to the same step."""
    with preemption_signals_heard():
        stopped, _ = fit(tmp_path, callbacks=(_SigtermAt(stop_at),), every_n_steps=10)
    assert stopped["status"] == "preempted" and stopped["global_step"] == stop_at
    summary, resumed = fit(tmp_path, every_n_steps=10)
    assert summary["status"] == "completed" and summary["spike_rollbacks"] == 1
    assert_same_weights(resumed.state_dict(), rolled[1].state_dict())
    ema = last_checkpoint(tmp_path)["ema"]["weights"]
    assert_same_weights(ema, last_checkpoint(rolled[2])["ema"]["weights"])


def test_a_plain_dataloader_goes_on_with_its_next_batch_after_the_rollback(
        rolled: tuple[dict[str, Any], Any, Path]) -> None:
    """A plain DataLoader cannot start a pass at a batch: after the rollback its pass goes on
    with the batch after the spike's, as a resumable loader's new pass does -- the same run."""
    summary, model = fit(plain=True)
    assert summary["status"] == "completed" and summary["global_step"] == 60
    assert summary["spike_rollbacks"] == 1 and summary["spike_skipped_batches"] == 6
    assert_same_weights(model.state_dict(), rolled[1].state_dict())


def test_a_plain_dataloader_with_rollbacks_resumes_bitwise_from_an_epoch_end(
        tmp_path: Path) -> None:
    """Two epochs, a spike in each: stopped at the first epoch's end (where a plain loader can
    resume) and re-run, the run ends with the uninterrupted run's weights."""
    two = {"max_epochs": 2}
    straight, model = fit(tmp_path / "a", plain=True, trainer=two)
    assert straight["spike_rollbacks"] == 2 and straight["global_step"] == 120
    stopped, _ = fit(tmp_path / "b", plain=True, trainer=two, stop_at_step=60)
    assert stopped["status"] == "preempted"
    summary, resumed = fit(tmp_path / "b", plain=True, trainer=two)
    assert summary["status"] == "completed" and summary["spike_rollbacks"] == 2
    assert_same_weights(resumed.state_dict(), model.state_dict())


def test_more_spikes_than_max_rollbacks_in_the_window_stop_the_run_as_diverged(
        tmp_path: Path) -> None:
    with pytest.raises(LossSpikeError, match=r"^stopped at step 46: loss .* after 1 "
                                             r"rollback\(s\) in the last 1000 steps"):
        fit(tmp_path, poison=(POISON, 45), spike={"max_rollbacks": 1})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["spike_rollbacks"] == 1


def test_non_finite_losses_in_a_row_roll_back_and_the_lr_is_lowered_after(
        clean: dict[str, Any]) -> None:
    lrs: dict[int, float] = {}
    optimizers: list[Any] = []

    def forward(model: torch.nn.Module, batch: Any) -> Any:
        if model.training:  # the LR each step trains at, by its first sample
            lrs[len(lrs)] = optimizers[0].param_groups[0]["lr"] if optimizers else 0.0
        return model(batch[0]), batch[1]

    class Grab:
        def on_fit_start(self, trainer: Any) -> None:
            optimizers.append(trainer.checkpointer.parts["optimizer"])

    summary, _ = fit(poison=(), nan=(40, 41), callbacks=(Grab(),), forward=forward,
                     spike={"max_nonfinite": 2, "lr_factor": 0.5, "lr_steps": 3})
    assert summary["spike_rollbacks"] == 1 and summary["nonfinite_steps"] == 2
    assert summary["status"] == "completed"
    # forwards 0-41 are steps 1-42; the rollback at 42 (to 40), then 3 steps at half the LR
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        torch.optim.SGD([torch.zeros(1)], lr=0.05), 0.05, total_steps=60)
    planned = []
    for _ in range(60):
        planned.append(schedule.get_last_lr()[0])
        schedule.optimizer.step()
        schedule.step()
    assert [lrs[i] for i in (42, 43, 44)] == pytest.approx([p / 2 for p in planned[40:43]])
    assert lrs[45] == pytest.approx(planned[43])  # back to the plan (undone steps: 2 behind)


# -- a GPU's way on the CPU: each loss read a step late ---------------------------------------

@pytest.fixture
def late_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step's loss copied without blocking and read a step later, as on CUDA."""
    monkeypatch.setattr(spike, "LATE_READS", frozenset({"cuda", "cpu"}))


@pytest.mark.usefixtures("late_reads")
def test_read_a_step_late_a_spike_is_rolled_back_a_step_later_the_same_every_time(
        tmp_path: Path) -> None:
    _, model = fit(tmp_path / "a", every_n_steps=10)
    record = summary_rollbacks(tmp_path / "a")
    assert [(r["step"], r["to_step"], r["batches"]) for r in record] == [(37, 30, 7)]
    with preemption_signals_heard():  # stopped after the rollback, then resumed
        assert fit(tmp_path / "b", callbacks=(_SigtermAt(45),), every_n_steps=10)[0][
            "status"] == "preempted"
    _, resumed = fit(tmp_path / "b", every_n_steps=10)
    assert_same_weights(resumed.state_dict(), model.state_dict())
    assert summary_rollbacks(tmp_path / "b") == record


@pytest.mark.usefixtures("late_reads")
def test_read_a_step_late_a_spike_at_a_snapshot_step_is_read_there_not_kept(
        tmp_path: Path) -> None:
    fit(tmp_path, poison=(39,), every_n_steps=10)  # step 40, a snapshot step: read there
    assert [(r["step"], r["to_step"]) for r in summary_rollbacks(tmp_path)] == [(40, 30)]
    # step 40's checkpoint holds the state rolled back to, and the saves go on after it
    assert {p.name for p in (tmp_path / "checkpoints").glob("step_*.pt")} >= {
        f"step_{step:09d}.pt" for step in (40, 50)}


def summary_rollbacks(run_dir: Path) -> list[dict[str, Any]]:
    return last_checkpoint(run_dir)["trainer"]["spike"]["rollbacks"]


def test_with_accumulation_and_a_loss_scaler_the_rollback_restores_the_scaler_and_resumes(
        tmp_path: Path) -> None:
    """Windows of 2 batches in 16-mixed (a GradScaler whose scale the snapshot holds): the
    spike in batch 35 is step 18's; back to step 10, batches 20-35 skipped."""
    options = {"accumulate_grad_batches": 2, "precision": "16-mixed"}
    summary, model = fit(tmp_path / "a", trainer=options, every_n_steps=10)
    assert [(r["step"], r["to_step"], r["batches"]) for r in summary_rollbacks(tmp_path / "a")] \
        == [(18, 10, 16)]
    assert summary["status"] == "completed" and summary["metrics"]["val/loss"] < 1
    with preemption_signals_heard():
        fit(tmp_path / "b", trainer=options, callbacks=(_SigtermAt(24),), every_n_steps=10)
    _, resumed = fit(tmp_path / "b", trainer=options, every_n_steps=10)
    assert_same_weights(resumed.state_dict(), model.state_dict())
    scaler = last_checkpoint(tmp_path / "b")["precision"]["scaler"]
    assert scaler == last_checkpoint(tmp_path / "a")["precision"]["scaler"]


def test_a_rollback_in_a_fit_of_two_models_restores_both() -> None:
    """Two copies of one net, each with its optimizer, trained alike by a step of their own:
    the rollback must take both back (the second would keep the poisoned steps otherwise)."""
    import torch.nn.functional as F

    a, b = net(), net()

    def step(ctx, batch) -> None:
        x, y = batch
        for name in ("a", "b"):
            ctx.optimize(name, F.cross_entropy(ctx.models[name](x), y))

    trainer = Trainer(TrainerConfig(device="cpu", log_every_n_steps=10, log_every_n_seconds=0,
                                    spike=SPIKE))
    trainer.fit({"a": a, "b": b},
                {n: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
                 for n, m in (("a", a), ("b", b))},
                ListLoader(batches(60, (POISON,))), step=step)
    assert len(trainer.state.spike["rollbacks"]) == 1
    assert_same_weights(a.state_dict(), b.state_dict())
