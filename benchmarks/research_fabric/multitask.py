"""examples/research/multitask.py written with Lightning Fabric, for the line count in
docs/research.md ("Your own step"). Not run here: lightning is not installed in this project.

The same program: one trunk, two heads, two losses logged apart, an accuracy per head,
resumable mid-epoch, a SIGTERM saving a checkpoint and exiting 75.
"""

import argparse
import os
import signal
import sys

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.loggers import TensorBoardLogger
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "research"))
from digits import CLASSES, SHIFTS, SIZE, digit_of, digits, shift_of

STOP = {"signal": None}


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Flatten(), nn.Linear(SIZE * SIZE, 128), nn.ReLU())
        self.digit, self.shift = nn.Linear(128, CLASSES), nn.Linear(128, SHIFTS)

    def forward(self, x):
        features = self.trunk(x)
        return {"digit": self.digit(features), "shift": self.shift(features)}


def batches(data, batch_size, epoch, start, shuffle=True):
    g = torch.Generator().manual_seed(1000 + epoch)
    order = torch.randperm(len(data), generator=g) if shuffle else torch.arange(len(data))
    for b in range(start, -(-len(data) // batch_size)):
        i = order[b * batch_size:(b + 1) * batch_size]
        yield ((data.images[i].float() / 255 - 0.3) / 0.3,
               {"digit": digit_of(data.labels[i]), "shift": shift_of(data.labels[i])})


def losses(outputs, targets):
    return {name: F.cross_entropy(outputs[name], targets[name]) for name in outputs}


def evaluate(fabric, model, val):
    accs = {"digit": MulticlassAccuracy(CLASSES), "shift": MulticlassAccuracy(SHIFTS)}
    sums, model = {"digit": 0.0, "shift": 0.0}, model.eval()
    with torch.no_grad():
        for x, y in batches(val, 256, 0, 0, shuffle=False):
            out = model(x.to(fabric.device))
            for name, part in losses(out, y).items():
                sums[name] += part.item() * len(x)
                accs[name].update(out[name], y[name])
    model.train()
    return {**{f"val/{n}": s / len(val) for n, s in sums.items()},
            **{f"val/{n}_acc": a.compute().item() for n, a in accs.items()}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", default="runs/multitask")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, lambda signum, frame: STOP.update(signal=signum))
    fabric = Fabric(accelerator="cpu", loggers=TensorBoardLogger(args.run_dir))
    train, val = digits(2048, seed=1), digits(512, seed=2)
    torch.manual_seed(0)
    model = TwoHeads()
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), 3e-3))
    state = {"model": model, "optimizer": optimizer, "step": 0, "rng": torch.get_rng_state(),
             "results": {}}
    if os.path.exists(f"{args.run_dir}/last.ckpt"):
        fabric.load(f"{args.run_dir}/last.ckpt", state)
        torch.set_rng_state(state["rng"])
    per_epoch = -(-len(train) // 64)
    while state["step"] < args.epochs * per_epoch:
        epoch, start = divmod(state["step"], per_epoch)
        for x, y in batches(train, 64, epoch, start):
            parts = losses(model(x.to(fabric.device)), y)
            loss = parts["digit"] + parts["shift"]
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            state["step"] += 1
            fabric.log_dict({"train/loss": loss.item(),
                             **{f"train/{n}": p.item() for n, p in parts.items()}}, state["step"])
            if state["step"] % per_epoch == 0:
                state["results"] = evaluate(fabric, model, val)
                fabric.log_dict(state["results"], state["step"])
            if state["step"] % 16 == 0 or STOP["signal"]:
                state["rng"] = torch.get_rng_state()
                fabric.save(f"{args.run_dir}/last.ckpt", state)
            if STOP["signal"]:
                sys.exit(75)
    print(f"val/digit_acc {state['results']['val/digit_acc']:.4f}, val/shift_acc "
          f"{state['results']['val/shift_acc']:.4f}")


if __name__ == "__main__":
    main()
