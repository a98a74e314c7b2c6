"""trainkit.optim.AdamW: torch's AdamW update and state layout, without importing torch._dynamo."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch.optim.lr_scheduler import OneCycleLR

from tests.conftest import REPO
from trainkit.optim import AdamW


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.Linear(8, 3))


def _groups(model: torch.nn.Module) -> list[dict]:
    # two groups with their own weight decay: options per group are honoured
    first, *rest = model.parameters()
    return [{"params": [first], "weight_decay": 0.1}, {"params": rest}]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    sched = OneCycleLR(opt, max_lr=[0.05, 0.02], total_steps=20)  # also cycles beta1
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()


@pytest.mark.parametrize("fused", [True, False])
def test_updates_exactly_as_torch_adamw(fused: bool) -> None:
    ours, theirs = _net(), _net()
    _train(ours, AdamW(_groups(ours), lr=0.01, weight_decay=0.01, fused=fused), 12)
    _train(theirs, torch.optim.AdamW(_groups(theirs), lr=0.01, weight_decay=0.01,
                                     fused=fused or None), 12)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator,
           steps: int) -> None:
    for _ in range(steps):
        x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def test_state_dicts_load_both_ways_and_resume_exactly() -> None:
    straight = _net()
    _steps(straight, AdamW(_groups(straight), lr=0.01), torch.Generator().manual_seed(1), 8)
    # 3 steps with torch's AdamW, 3 with ours from its state, 2 with torch's from ours: the
    # same as 8 steps with one optimizer
    model, gen = _net(), torch.Generator().manual_seed(1)
    first = torch.optim.AdamW(_groups(model), lr=0.01, fused=True)
    _steps(model, first, gen, 3)
    ours = AdamW(_groups(model), lr=0.5)
    ours.load_state_dict(first.state_dict())
    assert ours.param_groups[0]["weight_decay"] == 0.1 and ours.param_groups[1]["lr"] == 0.01
    _steps(model, ours, gen, 3)
    last = torch.optim.AdamW(_groups(model), lr=0.5, fused=True)
    last.load_state_dict(ours.state_dict())
    _steps(model, last, gen, 2)
    for a, b in zip(straight.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_bad_arguments_and_mismatched_state_are_refused() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="more than one group"):
        AdamW([{"params": [p]}, {"params": [p]}])
    with pytest.raises(ValueError, match="betas"):
        AdamW([p], betas=(0.9, 1.0))
    saved = AdamW([p, torch.nn.Parameter(torch.ones(1))]).state_dict()
    with pytest.raises(ValueError, match="different number of parameters"):
        AdamW([p]).load_state_dict(saved)


def test_zero_grad_in_place_keeps_the_tensor() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    grad = p.grad
    AdamW([p]).zero_grad(set_to_none=False)
    assert p.grad is grad and not p.grad.any()


def test_never_imports_torch_dynamo() -> None:
    code = textwrap.dedent("""
        import sys, torch
        from trainkit.optim import AdamW
        model = torch.nn.Linear(3, 2)
        opt = AdamW(model.parameters())
        model(torch.ones(1, 3)).sum().backward()
        opt.step(); opt.zero_grad()
        opt.load_state_dict(opt.state_dict())
        print("torch._dynamo" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
