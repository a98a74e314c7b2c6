"""Trainer policies through the library API: EMA evaluation, non-finite losses, best checkpoints,
preemption by real signals, time-based saves."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import last_checkpoint, preemption_signals_heard, sgd_without
from trainkit import (
    CheckpointConfig,
    Preemption,
    Trainer,
    TrainerConfig,
    load_checkpoint,
    seed_everything,
)
from trainkit.core.errors import TrainkitError
from trainkit.data import InMemoryLoader
from trainkit.data.sources.tensors import TensorData
from trainkit.loop.trainer import NonFiniteLossError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 3))


def _batches(n: int, nan_at: tuple[int, ...] = ()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    batches = []
    for i in range(n):
        x = torch.randn(8, 16, generator=g)
        y = torch.randint(0, 3, (8,), generator=g)
        if i in nan_at:
            x[0, 0] = float("nan")
        batches.append((x, y))
    return batches


def _trainer(run_dir: Path | None, **overrides) -> Trainer:
    checkpoint = {k: overrides.pop(k) for k in list(overrides)
                  if k in CheckpointConfig.__annotations__}
    config = TrainerConfig(device="cpu", log_every_n_steps=1, **overrides)
    return Trainer(config, run_dir=run_dir, checkpoint=CheckpointConfig(**checkpoint))


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def test_on_the_cpu_a_nan_between_logging_steps_is_skipped_exactly() -> None:
    """Host reads cost nothing on the CPU, so every step reads its check: the NaN step is not
    taken at all (no momentum or weight-decay move either), as if the batch had not been there."""
    data = _batches(20, nan_at=(3,))
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    trainer = Trainer(TrainerConfig(device="cpu", log_every_n_steps=10, log_every_n_seconds=0))
    summary = trainer.fit(model, optimizer, data)
    assert summary["nonfinite_steps"] == summary["skipped_steps"] == 1
    reference = sgd_without(_model(), data, 3, lr=0.1, momentum=0.9, weight_decay=0.01)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_evaluation_uses_the_ema_weights_which_are_checkpointed(tmp_path: Path) -> None:
    data = _batches(6)
    model = _model()
    summary = _trainer(tmp_path, max_epochs=2, ema_decay=0.8).fit(model, _sgd(model), data,
                                                                    val_data=data)
    state = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    averaged = _model()
    averaged.load_state_dict(state["ema"]["weights"])
    with torch.no_grad():
        expected = sum(F.cross_entropy(averaged(x), y) * len(y) for x, y in data) / 48
    assert summary["metrics"]["val/loss"] == pytest.approx(float(expected), rel=1e-5)
    assert state["ema"]["updates"] == 12
    assert not torch.equal(state["model"]["1.weight"], state["ema"]["weights"]["1.weight"])
    assert torch.equal(state["model"]["1.weight"], model[1].weight)  # the model's own weights


def test_non_finite_losses_skip_the_step_and_the_scheduler() -> None:
    data = _batches(8, nan_at=(2, 5))
    model = _model()
    optimizer = _sgd(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    summary = _trainer(None).fit(model, optimizer, data, scheduler=scheduler)
    assert summary["global_step"] == 8
    assert summary["skipped_steps"] == summary["nonfinite_steps"] == 2
    assert scheduler.last_epoch == 6
    # Skipping a step of plain SGD is the same as never seeing that batch.
    reference = _model()
    ref_opt = _sgd(reference)
    for i, (x, y) in enumerate(data):
        if i not in (2, 5):
            ref_opt.zero_grad()
            F.cross_entropy(reference(x), y).backward()
            ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_fp16_overflowing_gradients_skip_the_step_not_the_scheduler() -> None:
    model = _model()
    optimizer = _sgd(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    calls = 0

    def overflow_twice(grad: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return grad * float("inf") if calls <= 2 else grad  # a finite loss, inf gradients

    model[1].weight.register_hook(overflow_twice)
    summary = _trainer(None, precision="16-mixed").fit(model, optimizer, _batches(6),
                                                       scheduler=scheduler)
    assert summary["skipped_steps"] == 2 and summary["nonfinite_steps"] == 0
    assert scheduler.last_epoch == 4
    assert torch.isfinite(model[1].weight).all()


def test_consecutive_non_finite_losses_stop_the_run_keeping_the_checkpoint(
        tmp_path: Path) -> None:
    data = _batches(10, nan_at=(4, 5, 6, 7, 8, 9))
    model = _model()
    trainer = _trainer(tmp_path, nonfinite_patience=3, every_n_steps=2)
    with pytest.raises(NonFiniteLossError, match="NaN/inf for 3 steps in a row") as caught:
        trainer.fit(model, _sgd(model), data)
    assert "step 4" in caught.value.details[0]  # names the last good checkpoint
    last = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    assert last["global_step"] == 4  # no save during the streak, none at the stop
    assert torch.isfinite(last["model"]["1.weight"]).all()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["nonfinite_steps"] == 3


def test_a_diverged_run_keeps_its_last_evaluation_in_its_summary(tmp_path: Path) -> None:
    """Issue 61, fault 15: evaluated at step 3, diverged at step 6: summary.json has step 3's
    metrics, not ``{}``."""
    data = _batches(10, nan_at=(4, 5, 6, 7, 8, 9))
    model = _model()
    trainer = _trainer(tmp_path, nonfinite_patience=3, eval_every_n_steps=3)
    with pytest.raises(NonFiniteLossError):
        trainer.fit(model, _sgd(model), data, val_data=_batches(2))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "diverged"
    assert set(summary["metrics"]) == {"val/loss"} and summary["metrics"]["val/loss"] > 0


@pytest.mark.parametrize(("mode", "best_step"), [("min", 12), ("max", 4)])
def test_best_checkpoint_is_kept_apart_from_the_rotation(tmp_path: Path, mode: str,
                                                         best_step: int) -> None:
    data = _batches(4)
    model = _model()
    trainer = _trainer(tmp_path, max_epochs=3, every_n_steps=1, keep_last=1,
                       monitor="val/loss", mode=mode)
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.05), data, val_data=data)
    # the validation loss falls every epoch: min keeps the last epoch, max the first
    assert load_checkpoint(tmp_path / "checkpoints" / "best.pt")["global_step"] == best_step
    assert [p.name for p in (tmp_path / "checkpoints").glob("step_*.pt")] == [
        "step_000000012.pt"]
    assert load_checkpoint(tmp_path / "checkpoints" / "last.pt")["global_step"] == 12


def test_unknown_monitor_names_the_metrics(tmp_path: Path) -> None:
    model = _model()
    with pytest.raises(TrainkitError, match=r"checkpoint.monitor='val/acc'.*val/loss"):
        _trainer(tmp_path, monitor="val/acc").fit(model, _sgd(model), _batches(2),
                                                  val_data=_batches(1))


def _loader() -> InMemoryLoader:
    g = torch.Generator().manual_seed(3)
    data = TensorData(torch.randint(0, 255, (96, 1, 4, 4), dtype=torch.uint8, generator=g),
                      torch.randint(0, 3, (96,), generator=g), (0.5,), (0.25,), 3)
    return InMemoryLoader(data, 8, shuffle=True, seed=0)


def _signal_at(call: int, *signums: int):
    """A forward that raises real signals at the ``call``-th micro-batch."""
    count = 0

    def forward(model: nn.Module, batch):
        nonlocal count
        count += 1
        if count == call:
            for signum in signums:
                signal.raise_signal(signum)
        x, y = batch
        return model(x), y

    return forward


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1],
                         ids=lambda signum: signum.name)
def test_a_signal_stops_after_the_step_and_resume_is_bit_exact(tmp_path: Path,
                                                               signum: int) -> None:
    with preemption_signals_heard():
        _stop_and_resume(tmp_path, signum)


def _stop_and_resume(tmp_path: Path, signum: int) -> None:
    handler_before = signal.getsignal(signum)
    seed_everything(0)
    straight = _model()
    _trainer(tmp_path / "straight", max_epochs=2, accumulate_grad_batches=2).fit(
        straight, torch.optim.AdamW(straight.parameters(), lr=0.01), _loader())

    seed_everything(0)
    model = _model()
    run = tmp_path / "stopped"
    summary = _trainer(run, max_epochs=2, accumulate_grad_batches=2).fit(
        model, torch.optim.AdamW(model.parameters(), lr=0.01), _loader(),
        forward=_signal_at(7, signum))  # inside the 4th window: it finishes first
    assert summary["status"] == "preempted" and summary["global_step"] == 4
    assert load_checkpoint(run / "checkpoints" / "last.pt")["global_step"] == 4
    assert signal.getsignal(signum) == handler_before  # our handler is gone after fit

    seed_everything(123)  # the resumed run restores RNG state from the checkpoint
    resumed = _model()
    summary = _trainer(run, max_epochs=2, accumulate_grad_batches=2).fit(
        resumed, torch.optim.AdamW(resumed.parameters(), lr=0.01), _loader())
    assert summary["status"] == "completed" and summary["global_step"] == 12
    for p, q in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(p, q)


def test_an_ignored_sighup_stays_ignored(tmp_path: Path) -> None:
    """`nohup python -m trainkit.train ...`: the terminal closing must not stop the run."""
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        model = _model()
        summary = _trainer(tmp_path, max_epochs=1).fit(
            model, _sgd(model), _loader(), forward=_signal_at(2, signal.SIGHUP))
        assert summary["status"] == "completed"
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


def test_a_second_signal_aborts_at_once(tmp_path: Path) -> None:
    model = _model()
    with preemption_signals_heard(), pytest.raises(KeyboardInterrupt):
        _trainer(tmp_path, max_epochs=2).fit(
            model, _sgd(model), _loader(), forward=_signal_at(3, signal.SIGTERM, signal.SIGINT))
    assert not (tmp_path / "checkpoints" / "last.pt").exists()
    assert not (tmp_path / "summary.json").exists()


def test_time_based_checkpoints(tmp_path: Path) -> None:
    model = _model()
    _trainer(tmp_path, every_n_minutes=1e-9, keep_last=100).fit(model, _sgd(model), _batches(5))
    steps = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*.pt"))
    assert steps == [f"step_{s:09d}.pt" for s in range(1, 6)]


class StopAfter(Preemption):
    """A user's own stop condition: ``requested`` after ``steps`` forward passes."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps, self.seen = steps, 0

    @property
    def requested(self) -> bool:
        return self.received is not None or self.seen >= self.steps


@pytest.mark.parametrize("every_n_minutes", [0.0, 60.0])
def test_a_stop_request_ends_a_one_process_run_with_and_without_time_based_saves(
        tmp_path: Path, every_n_minutes: float) -> None:
    """Both ways the loop asks to stop in one process: through the vote (time-based saves on)
    and through the stop flag alone; a Preemption that overrides ``requested`` is heard."""
    preemption = StopAfter(3)

    def forward(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
        preemption.seen += 1
        return model(batch[0]), batch[1]

    model = _model()
    summary = _trainer(tmp_path, every_n_minutes=every_n_minutes).fit(
        model, _sgd(model), _batches(10), forward=forward, preemption=preemption)
    assert summary["status"] == "preempted" and summary["global_step"] == 3
    assert [p.name for p in (tmp_path / "checkpoints").glob("step_*.pt")] == ["step_000000003.pt"]


class NoisyImages(torch.utils.data.Dataset):
    """A map-style dataset with a random per-sample transform (noise and a random flip)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(4)
        self.x = torch.randn(60, 16, generator=g)
        self.y = torch.randint(0, 3, (60,), generator=g)

    def __len__(self) -> int:
        return 60

    def __getitem__(self, i: int):
        x = self.x[i] + 0.1 * torch.randn(16)
        return (x.flip(0) if torch.rand(()) < 0.5 else x), self.y[i]


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_with_workers_and_random_transforms_resumes_bit_exactly(
        tmp_path: Path, workers: int) -> None:
    from trainkit.data import make_loader

    def run(run_dir: Path, stop_at: int | None = None) -> tuple[nn.Module, dict]:
        seed_everything(0)
        model = _model()
        loader = make_loader(NoisyImages(), 8, shuffle=True, seed=0, num_workers=workers)
        summary = _trainer(run_dir, max_epochs=3).fit(
            model, torch.optim.AdamW(model.parameters(), lr=0.01), loader,
            stop_at_step=stop_at)
        return model, summary

    straight, _ = run(tmp_path / "straight")
    _, stopped = run(tmp_path / "resumed", stop_at=11)  # mid-epoch 1 (8 batches an epoch)
    assert stopped["status"] == "preempted"
    resumed, summary = run(tmp_path / "resumed")
    assert summary["global_step"] == 24
    for p, q in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(p, q)


def test_the_same_signal_twice_at_once_is_one_request_under_torchrun(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group kill under torchrun: the worker's own SIGTERM, then torchrun's forwarded copy."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    model = _model()
    with preemption_signals_heard():
        summary = _trainer(tmp_path, max_epochs=2).fit(
            model, _sgd(model), _loader(), forward=_signal_at(3, signal.SIGTERM, signal.SIGTERM))
    assert summary["status"] == "preempted" and summary["global_step"] == 3
    assert last_checkpoint(tmp_path)["global_step"] == 3


def test_the_same_signal_twice_without_a_launcher_aborts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Jupyter's stop button or Ctrl-C pressed twice: no launcher forwards copies, so the second
    press aborts at once, without saving."""
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    model = _model()
    with preemption_signals_heard(), pytest.raises(KeyboardInterrupt):
        _trainer(tmp_path, max_epochs=2).fit(
            model, _sgd(model), _loader(), forward=_signal_at(3, signal.SIGINT, signal.SIGINT))
    assert not list((tmp_path / "checkpoints").glob("*.pt"))


def test_fit_seeds_its_random_draws_from_the_config_seed() -> None:
    """TrainerConfig(seed=...) decides the dropout masks, whatever the process drew before."""
    def fit(seed: int, draws_before: int) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Dropout(0.5), nn.Linear(16, 3))
        torch.rand(draws_before)  # other code ran in between
        Trainer(TrainerConfig(device="cpu", seed=seed, max_epochs=2)).fit(
            model, _sgd(model), _batches(4))
        return model[2].weight.detach()

    assert torch.equal(fit(3, 1), fit(3, 1000))
    assert not torch.equal(fit(3, 1), fit(4, 1))
