"""No host read of the device per step: the NaN/inf check between logging steps runs on the device.

Reads are counted by patching the ``torch.Tensor`` methods that read a tensor on the host (the
same harness ``benchmarks.syncs`` runs on a GPU next to ``torch.cuda.set_sync_debug_mode``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks.syncs import fit_reads, gpu_path_on_the_cpu, text_forward, text_syncs
from tests.conftest import sgd_without
from trainkit import CheckpointConfig, Trainer, TrainerConfig, load_checkpoint
from trainkit.loop.trainer import NonFiniteLossError


@pytest.fixture(autouse=True)
def _device_path_on_the_cpu() -> Iterator[None]:
    """The GPU's path, run on the CPU: trainkit reads every CPU step (it costs nothing there)."""
    with gpu_path_on_the_cpu():
        yield


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_host_reads_grow_with_logging_steps_not_with_steps(precision: str) -> None:
    short = fit_reads(10, 5, "cpu", precision)
    long_same_logs = fit_reads(20, 10, "cpu", precision)
    long_more_logs = fit_reads(20, 5, "cpu", precision)
    assert short["global_step"] == 10 and long_same_logs["global_step"] == 20
    assert short["host_reads"] == long_same_logs["host_reads"], (short, long_same_logs)
    assert long_more_logs["host_reads"] > long_same_logs["host_reads"]  # the count sees reads


def test_fp16_reads_once_per_step_for_the_grad_scaler() -> None:
    """Documented: GradScaler reads its overflow flag every step; trainkit adds no read of its
    own (a step post-hook tells whether the optimizer stepped)."""
    short, long = fit_reads(10, 10, "cpu", "16-mixed"), fit_reads(20, 20, "cpu", "16-mixed")
    assert long["host_reads"] - short["host_reads"] == 1 * 10


def test_fp16_with_a_fused_optimizer_reads_nothing_per_step() -> None:
    """Issue 60.9: a fused AdamW skips an overflowed step in its kernel on GradScaler's flag;
    trainkit counts the skip on the device instead of reading the flag every step."""
    runs = [fit_reads(n, every, "cpu", "16-mixed", optimizer="fused_adamw")
            for n, every in ((10, 5), (20, 10), (20, 5))]
    assert runs[0]["host_reads"] == runs[1]["host_reads"], runs[:2]
    assert runs[2]["host_reads"] > runs[1]["host_reads"]  # the count sees reads
    assert runs[0]["host_syncs"] == runs[1]["host_syncs"]


def test_fused_fp16_overflow_skips_are_counted_at_logging_steps() -> None:
    """The skips counted on the device reach summary.json's skipped_steps (GradScaler's first
    steps overflow at its initial scale of 65536 on this model)."""
    from trainkit.loop.precision import Precision

    precision = Precision("16-mixed", "cpu")
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    skipped = 0
    for x, y in _batches(3, 0, 0):
        with precision.autocast():
            loss = nn.functional.cross_entropy(model(x), y) * 1e4  # overflows in fp16 grads
        precision.backward(loss)
        assert precision.step(optimizer)  # reported without a read: the kernel skipped
        optimizer.zero_grad()
    skipped = precision.read_skips()
    assert skipped == 3 and precision.read_skips() == 0


@pytest.mark.parametrize("log_every", [1, 7])
def test_a_fused_fp16_fit_counts_the_skipped_steps_a_non_fused_one_counts(log_every: int) -> None:
    def fit(fused: bool) -> dict:
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
        config = TrainerConfig(device="cpu", precision="16-mixed", log_every_n_steps=log_every,
                               log_every_n_seconds=0)
        return Trainer(config).fit(model, optimizer, _batches(12, 0, 0),
                                   criterion=lambda out, y: nn.functional.cross_entropy(out, y)
                                   * 1e4)

    plain, fused = fit(False), fit(True)
    assert plain["skipped_steps"] > 0
    assert fused["skipped_steps"] == plain["skipped_steps"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 3))


def _batches(n: int, nan_from: int, nan_to: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    batches = []
    for i in range(n):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 3, (8,), generator=g)
        if nan_from <= i < nan_to:
            x[0, 0] = float("nan")
        batches.append((x, y))
    return batches


def _trainer(run_dir: Path | None, every_n_steps: int = 0) -> Trainer:
    config = TrainerConfig(device="cpu", log_every_n_steps=10, log_every_n_seconds=0,
                           nonfinite_patience=3)
    checkpoint = CheckpointConfig(every_n_steps=every_n_steps)
    return Trainer(config, run_dir=run_dir, checkpoint=checkpoint)


def test_a_nan_between_logging_steps_is_dropped_on_the_device_and_counted() -> None:
    data = _batches(20, 3, 4)  # step 4: neither a logging nor a checkpoint step
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    summary = _trainer(None).fit(model, optimizer, data, scheduler=scheduler)
    assert summary["nonfinite_steps"] == summary["skipped_steps"] == 1
    assert scheduler.last_epoch == 20  # the host did not know at the time: documented
    # Zero gradients under plain SGD are a skipped step: the same weights as never seeing it.
    reference = sgd_without(_model(), data, 3, lr=0.1)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)


@pytest.mark.parametrize(("every_n_steps", "stop_step", "counted"), [(0, 10, 7), (2, 6, 3)])
def test_a_streak_between_reads_stops_the_run_at_the_next_read(
        tmp_path: Path, every_n_steps: int, stop_step: int, counted: int) -> None:
    """NaN from step 4 on, patience 3. Logging every 10 only, the streak is seen at step 10;
    with a checkpoint due at step 4 the host reads there, then checks every step: exact."""
    model = _model()
    trainer = _trainer(tmp_path, every_n_steps)
    with pytest.raises(NonFiniteLossError, match=f"stopped at step {stop_step}: the loss was "
                                                 f"NaN/inf for {counted} steps in a row"):
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(20, 3, 20))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["global_step"] == stop_step
    assert summary["nonfinite_steps"] == counted
    assert torch.isfinite(model[1].weight).all()
    if every_n_steps:
        last = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
        assert last["global_step"] == 2 and torch.isfinite(last["model"]["1.weight"]).all()


def test_a_step_that_logs_by_time_reads_its_check_on_the_host() -> None:
    """One logging policy (issue 48): a step the LogSchedule logs by time (here every step) is
    a read step like a logging step by count, so the streak from step 4 is counted exactly."""
    model = _model()
    config = TrainerConfig(device="cpu", log_every_n_steps=10, log_every_n_seconds=1e-9,
                           nonfinite_patience=3)
    with pytest.raises(NonFiniteLossError, match="stopped at step 6: the loss was NaN/inf for "
                                                 "3 steps in a row"):
        Trainer(config).fit(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            _batches(20, 3, 20))


def test_a_counted_text_window_reads_nothing_per_step() -> None:
    """Token-normalised loss and real tokens/s: a forward that declares ``count_targets`` over
    padded text, 2 batches a step, has its window's count (and, under DDP, the count's
    all-reduce) and its real tokens kept on the device: reads grow with logs, not steps."""
    runs = [text_syncs(n, every, "cpu") for n, every in ((6, 3), (12, 6), (12, 3))]
    assert [r["global_step"] for r in runs] == [6, 12, 12]
    assert runs[0]["host_reads"] == runs[1]["host_reads"], runs[:2]
    assert runs[0]["host_syncs"] == runs[1]["host_syncs"] == 0
    assert runs[2]["host_reads"] > runs[1]["host_reads"]  # the count sees reads


def test_the_text_count_sees_a_count_read_on_the_host() -> None:
    """The same harness fails a count that is read on the host every step (``int(...)``)."""
    def read_count(model: nn.Module, batch: dict[str, torch.Tensor]) -> object:
        return text_forward(model, batch)

    read_count.count_targets = lambda batch: torch.tensor(  # type: ignore[attr-defined]
        int((batch["labels"][:, 1:] != -100).sum()))
    runs = [text_syncs(n, every, "cpu", forward=read_count) for n, every in ((6, 3), (12, 6))]
    assert runs[1]["host_reads"] - runs[0]["host_reads"] == 12  # 2 batches a step, 6 more steps
