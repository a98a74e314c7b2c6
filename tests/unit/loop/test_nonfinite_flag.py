"""guard_finite's NaN/inf flag on the device: fused optimizers take it as ``found_inf`` (their
update skipped in the kernel), others have all gradients zeroed by two foreach kernels."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainkit.loop.precision import Precision
from trainkit.loop.step import WindowStep, default_forward, is_fused

CPU = torch.device("cpu")


class Poisoned(nn.Module):
    """Its output turns NaN (and so its loss and every gradient) when ``poison`` is set."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        self.poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return out * float("nan") if self.poison else out


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g)


def _run(make_optimizer, poison_second: bool) -> tuple[nn.Module, torch.optim.Optimizer, list]:
    model = Poisoned()
    optimizer = make_optimizer(model.parameters())
    step = WindowStep(model, optimizer=optimizer, precision=Precision("32", CPU),
                      criterion=F.cross_entropy, forward=default_forward, device=CPU)
    flags = []
    for poison in (False, poison_second, False):
        model.poison = poison
        flags.append(bool(step((_batch(),), guard_finite=True).finite_flag))
    return model, optimizer, flags


@pytest.mark.parametrize("fused", [True, False], ids=["fused_adam", "foreach_adam"])
def test_a_nan_step_leaves_the_weights_finite_and_the_next_steps_train(fused: bool) -> None:
    def adam(params):
        return torch.optim.Adam(params, lr=0.01, fused=fused, foreach=None if fused else True)

    model, optimizer, flags = _run(adam, poison_second=True)
    assert is_fused(optimizer) is fused
    assert flags == [True, False, True]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not hasattr(optimizer, "found_inf")  # handed to one step only
    clean, _, _ = _run(adam, poison_second=False)
    moved = [not torch.equal(a, b) for a, b in zip(model.parameters(), clean.parameters())]
    assert any(moved)  # the bad step differs from a good one (skipped or zero gradients)
    steps = {float(s["step"]) for s in optimizer.state.values()}
    # fused: the kernel skipped the bad step, its step count with it; foreach: a zero-gradient
    # step was taken (Adam's moments decay)
    assert steps == ({2.0} if fused else {3.0})


def test_plain_sgd_takes_no_step_on_a_nan_loss() -> None:
    """Zeroed gradients (not NaN * 0 = NaN): plain SGD's weights stay exactly as they were."""
    model = Poisoned()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = WindowStep(model, optimizer=optimizer, precision=Precision("32", CPU),
                      criterion=F.cross_entropy, forward=default_forward, device=CPU)
    before = copy.deepcopy(model.state_dict())
    model.poison = True
    assert not bool(step((_batch(),), guard_finite=True).finite_flag)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_fused_sgd_with_momentum_after_a_nan_first_step_trains_as_if_it_never_saw_it() -> None:
    """torch's fused SGD creates its momentum buffers (``empty_like``) before its kernel skips
    on ``found_inf``: a skipped first step would leave them uninitialised. The zero-gradient
    path gives momentum buffers of zeros instead: the next step is a first step's."""
    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)

    model = Poisoned()
    optimizer = sgd(model.parameters())
    step = WindowStep(model, optimizer=optimizer, precision=Precision("32", CPU),
                      criterion=F.cross_entropy, forward=default_forward, device=CPU)
    # freed blocks of the parameters' sizes holding large values, for empty_like to reuse
    junk = [torch.full_like(p, 1e6) for p in model.parameters() for _ in range(4)]
    del junk
    model.poison = True
    assert not bool(step((_batch(),), guard_finite=True).finite_flag)
    model.poison = False
    step((_batch(),), guard_finite=True)
    reference = Poisoned()  # the same initial weights; one good step only
    reference_sgd = sgd(reference.parameters())
    F.cross_entropy(reference(_batch()[0]), _batch()[1]).backward()
    reference_sgd.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b)


def test_fused_sgd_with_momentum_after_an_fp16_overflow_first_step_under_the_scaler() -> None:
    """The same under 16-mixed: GradScaler hands the fused kernel its found_inf, and a skipped
    first step must leave no momentum buffers behind (the next step is a first step)."""
    def run(poison_first: bool) -> nn.Module:
        model = Poisoned()
        precision = Precision("16-mixed", CPU)
        precision.load_state_dict({"mode": "16-mixed", "scaler": torch.amp.GradScaler(
            "cpu", init_scale=4.0).state_dict()})
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
        step = WindowStep(model, optimizer=optimizer, precision=precision,
                          criterion=F.cross_entropy, forward=default_forward, device=CPU)
        junk = [torch.full_like(p, 1e6) for p in model.parameters() for _ in range(4)]
        del junk  # freed blocks holding large values, for empty_like to reuse
        if poison_first:
            model.poison = True
            assert not step((_batch(),)).stepped
            model.poison = False
        assert step((_batch(),)).stepped
        return model

    for a, b in zip(run(poison_first=True).parameters(), run(poison_first=False).parameters()):
        torch.testing.assert_close(a, b)
