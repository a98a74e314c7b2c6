"""Step mechanics against plain PyTorch computed in the test."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainkit.core.errors import TrainkitError
from trainkit.loop.precision import Precision
from trainkit.loop.step import batch_size, default_forward, train_window, windows

CPU = torch.device("cpu")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _batches(sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
            for n in sizes]


def _step(model: nn.Module, window, precision: Precision | None = None, **kwargs):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    result = train_window(model, window, optimizer=optimizer,
                          precision=precision or Precision("32", CPU), criterion=F.cross_entropy,
                          forward=default_forward, device=CPU, **kwargs)
    return result, optimizer


def _reference_step(model: nn.Module, window) -> None:
    """One SGD step on the concatenation of the window: the update accumulation must match."""
    x = torch.cat([b[0] for b in window])
    y = torch.cat([b[1] for b in window])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


@pytest.mark.parametrize("sizes", [[8, 8, 8, 8], [8, 8, 3], [5]])
def test_accumulated_window_equals_one_big_batch(sizes: list[int]) -> None:
    window = _batches(sizes)
    model, reference = _model(), _model()
    result, _ = _step(model, window)
    _reference_step(reference, window)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert result.samples == sum(sizes) and result.stepped


def test_windows_keep_a_short_last_window() -> None:
    assert [len(w) for w in windows(range(10), 4)] == [4, 4, 2]
    assert [len(w) for w in windows(range(8), 4)] == [4, 4]
    assert [list(w) for w in windows(range(3), 1)] == [[0], [1], [2]]  # no accumulation


def test_batch_size_finds_the_first_tensor() -> None:
    assert batch_size((torch.zeros(5, 2), torch.zeros(5))) == 5
    assert batch_size({"ids": [torch.zeros(7)], "name": "x"}) == 7
    with pytest.raises(TypeError):
        batch_size(["no tensors"])


def test_clipping_equals_clip_grad_norm_on_true_gradients() -> None:
    window = _batches([16])
    model, reference = _model(), _model()
    result, _ = _step(model, window, clip_val=0.05)
    x, y = window[0]
    F.cross_entropy(reference(x), y).backward()
    expected_norm = nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    torch.testing.assert_close(result.grad_norm, expected_norm)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)


def test_fp16_clipping_sees_unscaled_gradients() -> None:
    window = _batches([16])
    model, reference = _model(), _model()
    precision = Precision("16-mixed", CPU)
    precision.scaler = torch.amp.GradScaler("cpu", init_scale=16.0)  # cannot overflow here
    result, _ = _step(model, window, precision=precision, clip_val=1e9)
    x, y = window[0]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(reference(x), y)
    loss.backward()
    true_norm = nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
    assert result.stepped
    torch.testing.assert_close(result.grad_norm, true_norm, rtol=1e-3, atol=1e-5)


def test_fp16_overflow_skips_the_step() -> None:
    model = _model()
    before = copy.deepcopy(model.state_dict())
    precision = Precision("16-mixed", CPU)

    def exploding(outputs, targets):
        return F.cross_entropy(outputs, targets) * float("inf")

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scale = precision.scaler.get_scale()
    result = train_window(model, _batches([8]), optimizer=optimizer, precision=precision,
                          criterion=exploding, forward=default_forward, device=CPU)
    assert not result.stepped
    assert precision.scaler.get_scale() < scale  # backed off
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


@pytest.mark.parametrize("mode", ["32", "bf16-mixed", "16-mixed"])
def test_a_non_finite_loss_skips_the_step_when_checked(mode: str) -> None:
    model = _model()
    before = copy.deepcopy(model.state_dict())
    window = _batches([8, 8])
    window[1][0][0, 0] = float("nan")
    result, _ = _step(model, window, Precision(mode, CPU), check_finite=True)
    assert not result.finite and not result.stepped and result.loss.isnan()
    assert all(p.grad is None for p in model.parameters())  # nothing leaks into the next step
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


def test_bf16_autocast_runs_on_cpu_and_trains() -> None:
    model = _model()
    precision = Precision("bf16-mixed", CPU)
    window = _batches([32])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(20):
        result = train_window(model, window, optimizer=optimizer, precision=precision,
                              criterion=F.cross_entropy, forward=default_forward, device=CPU)
        losses.append(result.loss.item())
    with precision.autocast():
        assert model(window[0][0]).dtype == torch.bfloat16
    assert losses[-1] < losses[0] * 0.7


def test_precision_state_round_trips() -> None:
    a = Precision("16-mixed", CPU)
    a.scaler = torch.amp.GradScaler("cpu", init_scale=123.0)
    b = Precision("16-mixed", CPU)
    b.load_state_dict(a.state_dict())
    assert b.scaler.get_scale() == 123.0
    with pytest.raises(TrainkitError, match=r"trainer\.precision=16-mixed"):
        Precision("32", CPU).load_state_dict(a.state_dict())
    assert Precision("bf16-mixed", CPU).state_dict() == {"mode": "bf16-mixed", "scaler": None}


def test_unknown_precision() -> None:
    with pytest.raises(TrainkitError, match="unknown precision"):
        Precision("fp8", CPU)


@pytest.mark.parametrize("total", [1, 2, 3, 4, 5, 9, 100])
def test_one_cycle_survives_short_runs(total: int) -> None:
    from trainkit.core.schedules import one_cycle

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    scheduler = one_cycle(optimizer, total)
    lrs = []
    for _ in range(total):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert max(lrs) <= 0.1 + 1e-12 and all(lr >= 0 for lr in lrs)
    if total >= 5:
        assert lrs[0] < max(lrs) and lrs[-1] < max(lrs)  # warms up, then anneals


def test_device_mean_folds_and_resets() -> None:
    from trainkit.observe.metrics import DeviceMean

    meter = DeviceMean(fold_every=4)
    for v in range(10):
        meter.add(torch.tensor(float(v)))
    assert meter.pop() == pytest.approx(4.5)
    assert meter.pop() != meter.pop()  # NaN once empty
    meter.add(torch.tensor(2.0, dtype=torch.bfloat16))
    assert meter.pop() == 2.0


class _OwnZeroGrad(torch.optim.SGD):
    """An optimizer with its own zero_grad, as one that keeps gradients elsewhere would have."""

    calls: list[bool]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.calls.append(set_to_none)
        super().zero_grad(set_to_none)


@pytest.mark.parametrize("optimizer_class", [torch.optim.SGD, torch.optim.AdamW, _OwnZeroGrad])
def test_a_step_drops_the_gradients_as_zero_grad_would(optimizer_class: type) -> None:
    model = nn.Linear(4, 2)
    optimizer = optimizer_class(model.parameters(), lr=0.1)
    optimizer.calls = []
    batch = (torch.randn(8, 4), torch.randint(0, 2, (8,)))
    before = copy.deepcopy(model.state_dict())
    train_window(model, [batch], optimizer=optimizer, precision=Precision("32"),
                 criterion=F.cross_entropy, forward=default_forward, device=torch.device("cpu"))
    assert all(p.grad is None for p in model.parameters())  # set_to_none, as the loop needs
    assert not torch.equal(before["weight"], model.weight)  # the step was taken first
    # torch's own Optimizer.zero_grad is done directly; a class's own zero_grad is called
    assert optimizer.calls == ([True] if optimizer_class is _OwnZeroGrad else [])


@pytest.mark.parametrize(("precision", "window"), [("32", 1), ("bf16-mixed", 1), ("32", 3)],
                         ids=["plain", "autocast", "accumulation"])
def test_wrap_forward_once_reaches_the_next_forward_on_every_path(precision: str,
                                                                   window: int) -> None:
    """The advice's host-read sampling: under bf16 (what auto picks on a GPU) and accumulation
    the step calls another bound forward than the plain path; the wrapper must reach it once,
    and a request every log window must not nest wrappers that never run."""
    from trainkit.loop.step import WindowStep

    model = _model()
    step = WindowStep(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      precision=Precision(precision, CPU), criterion=F.cross_entropy,
                      forward=default_forward, device=CPU)
    seen = []

    def counting(forward):
        def counted(m, batch):
            seen.append(len(batch[0]))
            return forward(m, batch)
        return counted

    step.wrap_forward_once(counting)
    step.wrap_forward_once(counting)  # a second window's request before the first ran
    batches = _batches([4, 5, 6][:window])
    step(batches)
    step(batches)
    assert seen == [4]  # the first micro-batch of the first step, once
    assert step.forward is default_forward
