"""The logged ``optim/grad_norm`` averages windows that stepped: fp16 overflows are left out."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from trainkit import Trainer, TrainerConfig


def test_an_overflowed_fp16_window_does_not_make_the_logged_norm_inf(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 3))
    calls = 0

    def overflow_first(grad: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return grad * float("inf") if calls == 1 else grad  # a finite loss, inf gradients

    model[1].weight.register_hook(overflow_first)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 16, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(4)]
    config = TrainerConfig(device="cpu", precision="16-mixed", gradient_clip_val=1e9,
                           log_every_n_steps=2, log_every_n_seconds=0)
    summary = Trainer(config, run_dir=tmp_path).fit(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data)
    assert summary["skipped_steps"] == 1  # the first window overflowed
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    norms = [e.value for e in events.Scalars("optim/grad_norm")]
    assert len(norms) == 2 and all(math.isfinite(n) and n > 0 for n in norms), norms
