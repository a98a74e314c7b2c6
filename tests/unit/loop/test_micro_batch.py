"""trainer.micro_batch_size: the same step in smaller pieces, found on out-of-memory in auto.

The error is the real ``torch.cuda.OutOfMemoryError`` (constructible without a GPU), raised by
the test's model for a forward over more samples than it "fits", as an exhausted GPU would.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from trainkit import CheckpointConfig, Trainer, TrainerConfig
from trainkit.core.errors import ConfigError, TrainkitError
from trainkit.loop.micro_batch import split


class Fits(nn.Module):
    """Raises out-of-memory for a forward over more than ``limit`` samples."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.limit, self.sizes = limit, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.sizes.append(len(x))
        if len(x) > self.limit:
            raise torch.cuda.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {len(x)} samples' activations")
        return self.net(x)


def _batches(n: int = 4, size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 6, generator=g), torch.randint(0, 3, (size,), generator=g))
            for _ in range(n)]


def _fit(run_dir: Path, micro: int | str | None, limit: int, steps: int = 2) -> Fits:
    model = Fits(limit)
    trainer = Trainer(TrainerConfig(device="cpu", max_steps=steps, micro_batch_size=micro,
                                    accumulate_grad_batches=2, log_every_n_steps=1),
                      run_dir=run_dir, checkpoint=CheckpointConfig(every_n_steps=1))
    trainer.fit(model, torch.optim.AdamW(model.parameters(), lr=0.01), _batches())
    return model


def test_auto_halves_until_it_fits_and_trains_as_that_size_from_the_start(
        tmp_path: Path) -> None:
    auto = _fit(tmp_path / "auto", "auto", limit=4)
    fixed = _fit(tmp_path / "fixed", 4, limit=4)
    # the first step tried 16, then 8, then 4 (two batches of the window each); then 4 only
    assert auto.sizes[:3] == [16, 8, 4] and set(auto.sizes[3:]) == {4}
    assert set(fixed.sizes) == {4} and len(fixed.sizes) == 2 * 2 * 4
    for a, b in zip(auto.parameters(), fixed.parameters()):
        assert torch.equal(a, b)  # the same global batch, the same math, bit for bit
    summary = json.loads((tmp_path / "auto" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["micro_batch_size"] == 4
    log = (tmp_path / "auto" / "train.log").read_text()
    assert "with micro-batches of 16: the same step again with micro-batches of 8" in log
    assert "with micro-batches of 8: the same step again with micro-batches of 4" in log
    # the size is in the checkpoint, and a resumed run starts from it: no out-of-memory again
    resumed = Fits(limit=4)
    Trainer(TrainerConfig(device="cpu", max_epochs=2, max_steps=3, micro_batch_size="auto",
                          accumulate_grad_batches=2), run_dir=tmp_path / "auto").fit(
        resumed, torch.optim.AdamW(resumed.parameters(), lr=0.01), _batches())
    assert resumed.sizes == [4] * 8  # one step: two batches of 16, each in four


def test_auto_at_one_sample_ends_with_the_out_of_memory_line(tmp_path: Path) -> None:
    with pytest.raises(TrainkitError, match="out of memory on cpu at step 0"):
        _fit(tmp_path, "auto", limit=0)
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "oom"


def test_a_fixed_size_splits_without_retrying(tmp_path: Path) -> None:
    with pytest.raises(TrainkitError, match="out of memory"):
        _fit(tmp_path, 8, limit=4)


def test_split_slices_the_batch_dimension_and_shares_the_rest() -> None:
    batch = {"x": torch.arange(10).reshape(5, 2), "y": torch.arange(5), "scale": torch.tensor(2),
             "name": "b"}
    parts = split(batch, 2)
    assert [len(p["y"]) for p in parts] == [2, 2, 1]
    assert torch.equal(torch.cat([p["x"] for p in parts]), batch["x"])
    assert all(p["scale"] is batch["scale"] and p["name"] == "b" for p in parts)


@pytest.mark.parametrize("value", [0, "half", True, 2.5])
def test_a_bad_setting_is_one_line(value: object) -> None:
    with pytest.raises(ConfigError, match=r"trainer\.micro_batch_size=.*use auto"):
        TrainerConfig(micro_batch_size=value)
