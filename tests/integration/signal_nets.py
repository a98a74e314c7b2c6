"""A model that signals its own process while it is evaluated (test_newcomer_walk.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
from torch import nn


class EvalSignalNet(nn.Module):
    """A two-layer perceptron for 28x28 images that sends SIGTERM to its own process at its first
    forward in eval mode -- a signal that lands during an evaluation, without racing the run.

    Args:
        num_classes: outputs.
        once: a file made when the signal is sent; while it exists, no signal (the resumed run).
    """

    def __init__(self, num_classes: int = 10, once: str | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 32), nn.ReLU(),
                                 nn.Linear(32, num_classes))
        self.once = Path(once) if once else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and self.once is not None and not self.once.exists():
            self.once.touch()
            os.kill(os.getpid(), signal.SIGTERM)
        return self.net(x)
