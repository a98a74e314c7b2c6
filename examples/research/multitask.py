"""A multi-task net: one trunk, two heads (the digit, and its shift), two losses.

    python examples/research/multitask.py --run-dir runs/multitask

No step of your own is needed: the forward returns both heads' outputs and both targets by
name, the criterion returns the loss with its parts (logged as ``train/digit`` and
``train/shift``, and ``val/digit``, ``val/shift``: computed once), and ``trainkit.Select``
applies a torchmetrics metric to one output. Under ``trainkit.preemptible()`` a signal stops
the script with exit status 75; the same command resumes it.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from digits import CLASSES, SHIFTS, SIZE, digit_of, digits, shift_of
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

import trainkit
from trainkit import CheckpointConfig, InMemoryLoader, Select, Trainer, TrainerConfig


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Flatten(), nn.Linear(SIZE * SIZE, 128), nn.ReLU())
        self.digit, self.shift = nn.Linear(128, CLASSES), nn.Linear(128, SHIFTS)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.trunk(x)
        return {"digit": self.digit(features), "shift": self.shift(features)}


def forward(model: nn.Module, batch):
    return model(batch[0]), {"digit": digit_of(batch[1]), "shift": shift_of(batch[1])}


def criterion(outputs, targets):
    parts = {name: F.cross_entropy(outputs[name], targets[name]) for name in outputs}
    return parts["digit"] + parts["shift"], parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/multitask")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    with trainkit.preemptible():
        train, val = digits(2048, seed=1), digits(512, seed=2)
        torch.manual_seed(0)
        model = TwoHeads()
        summary = Trainer(TrainerConfig(max_epochs=args.epochs, device="cpu", log_every_n_steps=16),
                          run_dir=args.run_dir,
                          checkpoint=CheckpointConfig(every_n_steps=16, keep_last=2)).fit(
            model, torch.optim.Adam(model.parameters(), 3e-3),
            InMemoryLoader(train, 64, shuffle=True, seed=1),
            val_data=InMemoryLoader(val, 256, shuffle=False), forward=forward,
            criterion=criterion,
            metrics={"digit_acc": Select(MulticlassAccuracy(CLASSES), "digit", "digit"),
                     "shift_acc": Select(MulticlassAccuracy(SHIFTS), "shift", "shift")})
        print(f"val/digit_acc {summary['metrics']['val/digit_acc']:.4f}, val/shift_acc "
              f"{summary['metrics']['val/shift_acc']:.4f}")


if __name__ == "__main__":
    main()
