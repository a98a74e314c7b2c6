"""examples/research/distill.py written with Lightning Fabric, for the line count in
docs/research.md ("Your own step"). Not run here: lightning is not installed in this project.

The same program: a teacher, then a student on KL + CE, each phase resumable mid-epoch from its
own folder, a SIGTERM saving a checkpoint and exiting 75, a finished phase skipped on a re-run.
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
from digits import CLASSES, SIZE, digit_of, digits

T, ALPHA = 2.0, 0.7
STOP = {"signal": None}


def mlp(hidden):
    return nn.Sequential(nn.Flatten(), nn.Linear(SIZE * SIZE, hidden), nn.ReLU(),
                         nn.Linear(hidden, CLASSES))


def batches(data, batch_size, epoch, start, seed):
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    order = torch.randperm(len(data), generator=g)
    for b in range(start, len(data) // batch_size + (len(data) % batch_size > 0)):
        i = order[b * batch_size:(b + 1) * batch_size]
        yield (data.images[i].float() / 255 - 0.3) / 0.3, digit_of(data.labels[i])


def evaluate(fabric, model, val):
    acc, model = MulticlassAccuracy(CLASSES).to(fabric.device), model.eval()
    with torch.no_grad():
        for i in range(0, len(val), 256):
            x = (val.images[i:i + 256].float() / 255 - 0.3) / 0.3
            y = digit_of(val.labels[i:i + 256])
            acc.update(model(x.to(fabric.device)), y.to(fabric.device))
    model.train()
    return acc.compute().item()


def phase(name, run_dir, model, teacher, lr, epochs, train, val):
    folder = f"{run_dir}/{name}"
    fabric = Fabric(accelerator="cpu", loggers=TensorBoardLogger(folder))
    optimizer = torch.optim.Adam(model.parameters(), lr)
    model, optimizer = fabric.setup(model, optimizer)
    if teacher is not None:
        teacher = fabric.setup_module(teacher).eval()
    state = {"model": model, "optimizer": optimizer, "step": 0, "rng": torch.get_rng_state(),
             "acc": None}
    if os.path.exists(f"{folder}/last.ckpt"):
        fabric.load(f"{folder}/last.ckpt", state)
        torch.set_rng_state(state["rng"])
    per_epoch = -(-len(train) // 64)
    while state["step"] < epochs * per_epoch:
        epoch, start = divmod(state["step"], per_epoch)
        for x, y in batches(train, 64, epoch, start, seed=1):
            x, y = x.to(fabric.device), y.to(fabric.device)
            out = model(x)
            ce = F.cross_entropy(out, y)
            if teacher is None:
                loss = ce
            else:
                with torch.no_grad():
                    t = teacher(x)
                kl = F.kl_div(F.log_softmax(out / T, 1), F.log_softmax(t / T, 1),
                              log_target=True, reduction="batchmean") * T * T
                loss = ALPHA * kl + (1 - ALPHA) * ce
                fabric.log_dict({"train/kl": kl.item(), "train/ce": ce.item()}, state["step"])
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            state["step"] += 1
            fabric.log("train/loss", loss.item(), state["step"])
            if state["step"] % per_epoch == 0:
                state["acc"] = evaluate(fabric, model, val)
                fabric.log("val/acc", state["acc"], state["step"])
            if state["step"] % 16 == 0 or STOP["signal"]:
                state["rng"] = torch.get_rng_state()
                fabric.save(f"{folder}/last.ckpt", state)
            if STOP["signal"]:
                sys.exit(75)
    return state["acc"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", default="runs/distill")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, lambda signum, frame: STOP.update(signal=signum))
    train, val = digits(2048, seed=1), digits(512, seed=2)
    torch.manual_seed(0)
    teacher, student = mlp(256), mlp(24)
    taught = phase("teacher", args.run_dir, teacher, None, 3e-3, args.epochs, train, val)
    if STOP["signal"]:
        sys.exit(75)
    learnt = phase("student", args.run_dir, student, teacher, 1e-2, args.epochs, train, val)
    print(f"teacher val/acc {taught:.4f}, student val/acc {learnt:.4f}")


if __name__ == "__main__":
    main()
