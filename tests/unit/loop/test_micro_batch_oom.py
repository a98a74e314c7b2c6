"""trainer.micro_batch_size=auto where out-of-memory strikes after the backward: clipping is
retried with the loss scaler's state of the step reset, the optimizer step is not retried, and
the run's report reads the memory of the error it ends on before anything is released.

On the CPU the errors are the real ``torch.OutOfMemoryError`` raised where an exhausted GPU
would raise it (the norms of clipping, the end of ``optimizer.step``); the GPU tests at the end
run out of real CUDA memory under a per-process cap.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from tests.unit.loop.test_micro_batch import Fits
from trainkit import CheckpointConfig, Trainer, TrainerConfig
from trainkit.config import ProfileConfig
from trainkit.core.errors import TrainkitError
from trainkit.loop import oom
from trainkit.loop.micro_batch import MicroBatching
from trainkit.loop.precision import Precision
from trainkit.loop.step import WindowStep, default_forward
from trainkit.loop.train_state import TrainState
from trainkit.observe import profile

CPU = torch.device("cpu")


class OutOfMemoryInNorm(TorchFunctionMode):
    """Raises out-of-memory at the first norm computed under it (clipping's)."""

    def __init__(self) -> None:
        super().__init__()
        self.raised = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.raised and "norm" in getattr(func, "__name__", ""):
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate the norms")
        return func(*args, **(kwargs or {}))


def _batch(size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(size, 6, generator=g), torch.randint(0, 3, (size,), generator=g)


def _fp16_step(setting: int | str) -> tuple[nn.Module, MicroBatching, TrainState]:
    """16-mixed on the CPU, loss scale 4, SGD, clipping by a norm too large to change a thing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    precision = Precision("16-mixed", CPU)
    precision.load_state_dict({"mode": "16-mixed", "scaler": torch.amp.GradScaler(
        "cpu", init_scale=4.0).state_dict()})
    step = WindowStep(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      precision=precision, criterion=F.cross_entropy, forward=default_forward,
                      device=CPU, clip_val=1e9)
    state = TrainState()
    return model, MicroBatching(step, setting, state), state


def test_a_step_retried_after_out_of_memory_in_clipping_updates_as_a_clean_step() -> None:
    """The first try unscaled the gradients before its norm ran out: the retry's new, scaled
    gradients must be unscaled and checked again, not stepped 4x (the loss scale) too large."""
    model, auto, state = _fp16_step("auto")
    with OutOfMemoryInNorm() as mode:
        result = auto([_batch()])
    assert mode.raised == 1 and state.micro_batch_size == 8 and result.stepped
    clean, fixed, _ = _fp16_step(8)  # the size the retry ran at, never out of memory
    assert fixed([_batch()]).stepped
    for a, b in zip(model.parameters(), clean.parameters()):
        torch.testing.assert_close(a, b)


class OutOfMemoryAfterStep(torch.optim.AdamW):
    """foreach AdamW whose first step runs out of memory after it updated its state in place,
    as torch's does when its last buffer does not fit."""

    def step(self, closure=None):
        loss = super().step(closure)
        if not getattr(self, "ran_out", False):
            self.ran_out = True
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate exp_avg_sq")
        return loss


def test_out_of_memory_in_the_optimizer_step_ends_the_run_unretried(tmp_path: Path) -> None:
    model = Fits(limit=16)
    optimizer = OutOfMemoryAfterStep(model.parameters(), lr=0.01, foreach=True)
    trainer = Trainer(TrainerConfig(device="cpu", max_steps=2, micro_batch_size="auto",
                                    log_every_n_steps=1), run_dir=tmp_path)
    with pytest.raises(TrainkitError, match="out of memory on cpu at step 0"):
        trainer.fit(model, optimizer, [_batch(), _batch()])
    assert model.sizes == [16]  # one forward: the step was not tried again at 8
    assert {float(s["step"]) for s in optimizer.state.values()} == {1.0}  # not 2
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "oom"
    assert "in the optimizer step: not retried" in (tmp_path / "train.log").read_text()


def test_the_report_reads_the_memory_of_the_last_error_once_before_releasing_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each error auto recovers from: its snapshot, then its release. The one it gives up on:
    snapshot, figures and allocator summary (oom.report), then one release -- not a release
    by auto and a second snapshot of the emptied cache over the first."""
    events: list[tuple[str, str]] = []

    def recording(name, function):
        def record(*args, **kwargs):
            error = args[1] if name == "snapshot" else args[0]
            events.append((name, str(error).split("allocate ")[-1]))
            return function(*args, **kwargs)
        return record

    monkeypatch.setattr(oom, "report", recording("report", oom.report))
    monkeypatch.setattr(oom, "release", recording("release", oom.release))
    monkeypatch.setattr(profile.Profiler, "out_of_memory",
                        recording("snapshot", profile.Profiler.out_of_memory))
    trainer = Trainer(TrainerConfig(device="cpu", max_steps=1, micro_batch_size="auto",
                                    profile=ProfileConfig(enabled=True, wait=10)),
                      run_dir=tmp_path, checkpoint=CheckpointConfig(every_n_steps=0))
    model = Fits(limit=0)
    with pytest.raises(TrainkitError, match="out of memory"):
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), [_batch(4)])
    recovered = [(name, f"{n} samples' activations") for n in (4, 2)
                 for name in ("snapshot", "release")]
    last = "1 samples' activations"
    assert events == [*recovered, ("snapshot", last), ("report", last), ("release", last)]


# -- on a GPU: real CUDA out-of-memory errors under a per-process cap --------------------------

MIB = 2**20
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class HungryBackward(torch.autograd.Function):
    """Identity forward; a backward that allocates ``per_sample`` bytes per sample on the GPU
    (held until it returns), as a large activation's gradient would."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, per_sample: int) -> torch.Tensor:
        ctx.per_sample = per_sample
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scratch = torch.empty(len(grad) * ctx.per_sample, dtype=torch.uint8, device=grad.device)
        del scratch  # allocated: past the cap, the real CUDA out-of-memory error
        return grad, None


class GpuNet(nn.Module):
    """Linear, ReLU, Linear; with ``per_sample``, a hungry backward between the first two."""

    def __init__(self, per_sample: int = 0, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 4))
        self.per_sample = per_sample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.net[0](x)  # requires grad: the hungry backward runs
        if self.per_sample:
            hidden = HungryBackward.apply(hidden, self.per_sample)
        return self.net[2](self.net[1](hidden))


@pytest.fixture
def capped_gpu():
    """``cap(extra_bytes)``: this process may reserve what it holds now plus ``extra_bytes``."""
    torch.cuda.empty_cache()

    def cap(extra: int) -> None:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, (torch.cuda.memory_reserved() + extra) / total))

    yield cap
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()


def _gpu_batches(n: int = 2, size: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(size, 32, generator=g), torch.randint(0, 4, (size,), generator=g))
            for _ in range(n)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_gpu_out_of_memory_in_backward_is_retried_with_smaller_micro_batches(
        tmp_path: Path, precision: str, capped_gpu) -> None:
    if precision == "bf16-mixed" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no native bf16")  # counted as a failure by gpu_check
    model = GpuNet(per_sample=16 * MIB).cuda()
    capped_gpu(512 * MIB)  # 64 samples' backward wants 1 GiB, 16 samples' 256 MiB
    trainer = Trainer(TrainerConfig(device="cuda", max_steps=2, micro_batch_size="auto",
                                    precision=precision, gradient_clip_val=1.0,
                                    log_every_n_steps=1), run_dir=tmp_path / "auto")
    summary = trainer.fit(model, torch.optim.AdamW(model.parameters(), lr=0.01), _gpu_batches())
    assert summary["status"] == "completed" and 1 <= summary["micro_batch_size"] <= 32
    assert "the same step again with micro-batches of" in (tmp_path / "auto/train.log").read_text()
    # the same steps as a run at that size from the start (the loss scaler's state reset)
    fixed = GpuNet().cuda()  # no hungry backward: the same math, never out of memory
    Trainer(TrainerConfig(device="cuda", max_steps=2, precision=precision,
                          micro_batch_size=summary["micro_batch_size"], gradient_clip_val=1.0),
            run_dir=tmp_path / "fixed").fit(
        fixed, torch.optim.AdamW(fixed.parameters(), lr=0.01), _gpu_batches())
    for a, b in zip(model.parameters(), fixed.parameters()):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_gpu_out_of_memory_in_the_step_ends_the_run_with_the_report(
        tmp_path: Path, precision: str, capped_gpu) -> None:
    if precision == "bf16-mixed" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no native bf16")
    model = GpuNet(width=2**20).cuda()  # 39 M parameters: 148 MiB of fp32 weights
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    # the gradients, autocast's copies of the weights and the activations fit (~1.8x the
    # weights); the gradients with AdamW's two moments (3x) do not
    capped_gpu(params * 5 // 2)
    trainer = Trainer(TrainerConfig(device="cuda", max_steps=3, micro_batch_size="auto",
                                    precision=precision, log_every_n_steps=1), run_dir=tmp_path)
    with pytest.raises(TrainkitError, match="out of memory on cuda"):
        trainer.fit(model, torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True),
                    _gpu_batches(size=8))
    log = (tmp_path / "train.log").read_text()
    assert "in the optimizer step: not retried" in log and "allocator summary" in log
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "oom"
