"""Out of memory wherever it happens in fit: one line of advice, status oom, references dropped.

The error is the real ``torch.cuda.OutOfMemoryError`` (constructible without a GPU), raised by the
test's own model where an exhausted GPU would raise it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from trainkit import CheckpointConfig, Trainer, TrainerConfig
from trainkit.core.errors import TrainkitError


class Exhausting(nn.Module):
    """Raises out-of-memory in the ``at``-th training forward, in evaluation, or when moved."""

    def __init__(self, at: int = 0, in_eval: bool = False, when_moved: bool = False,
                 when_loaded: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 3)
        self.at, self.in_eval, self.when_moved, self.calls = at, in_eval, when_moved, 0
        self.when_loaded = when_loaded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += self.training
        if (self.training and self.calls == self.at) or (self.in_eval and not self.training):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.linear(x)

    def _apply(self, fn, recurse=True):
        if self.when_moved:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return super()._apply(fn, recurse)

    def load_state_dict(self, *args, **kwargs):
        if self.when_loaded:  # resuming: the checkpoint's tensors land on the device
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return super().load_state_dict(*args, **kwargs)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(n)]


@pytest.mark.parametrize(("model", "step"), [
    (Exhausting(at=3), 2),  # a training step
    (Exhausting(in_eval=True), 4),  # evaluation after the epoch
    (Exhausting(when_moved=True), 0),  # moving the model to the device
    (Exhausting(when_loaded=True), 0),  # resuming from the checkpoint a first run left
], ids=["step", "evaluation", "moving_the_model", "resuming"])
def test_out_of_memory_ends_with_one_line_and_status_oom(tmp_path: Path, model: nn.Module,
                                                        step: int) -> None:
    if model.when_loaded:
        first = Exhausting()
        Trainer(TrainerConfig(device="cpu", max_steps=2), run_dir=tmp_path).fit(
            first, torch.optim.SGD(first.parameters(), lr=0.1), _batches(4))
    trainer = Trainer(TrainerConfig(device="cpu", log_every_n_steps=1), run_dir=tmp_path,
                      checkpoint=CheckpointConfig(save_last=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TrainkitError) as caught:
        trainer.fit(model, optimizer, _batches(4), val_data=_batches(1))
    line = f"trainkit: {caught.value}"
    assert "\n" not in line and len(line) <= 200, line
    assert f"out of memory on cpu at step {step}" in line
    assert "data.batch_size" in line and "accumulate_grad_batches" in line
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "oom" and summary["global_step"] == step
    # the details: on the error for the entry point to print (when it carries them), or logged
    shown = "\n".join(getattr(caught.value, "details", [])) + (tmp_path / "train.log").read_text()
    assert "out of memory: CUDA out of memory. Tried to allocate" in shown
    assert "precision 32" in shown and "checkpoints are untouched" in shown
    assert all(p.grad is None for p in model.parameters())  # the step's gradients let go


def test_release_drops_what_the_failed_frames_hold_while_the_error_is_still_alive() -> None:
    import weakref

    from trainkit.loop.oom import release

    held: list[weakref.ref] = []

    def step() -> None:
        activation = torch.ones(1000)  # what a failed forward leaves in its frame
        held.append(weakref.ref(activation))
        raise torch.cuda.OutOfMemoryError("CUDA out of memory.")

    model = nn.Linear(4, 2)
    model(torch.ones(3, 4)).sum().backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        step()
    except torch.cuda.OutOfMemoryError as err:
        assert held[0]() is not None  # the traceback keeps it alive...
        release(err, optimizer)
        assert held[0]() is None  # ...until release, before any cache would be emptied
        assert model.weight.grad is None
