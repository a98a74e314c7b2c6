"""examples/research/simclr.py written with Lightning Fabric, for the line count in
docs/research.md ("Your own step"). Not run here: lightning is not installed in this project.

The same program: NT-Xent pre-training, then a linear probe on the frozen encoder, each phase
resumable mid-epoch from its own folder, a SIGTERM saving a checkpoint and exiting 75.
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

TAU = 0.2
STOP = {"signal": None}


def augment(x):
    shifted = torch.stack([x.roll(s, 3) for s in (-1, 0, 1)])
    x = shifted[torch.randint(0, 3, (len(x),), device=x.device), torch.arange(len(x))]
    return (x + 0.3 * torch.randn_like(x)) * (torch.rand_like(x) > 0.1)


def nt_xent(z1, z2):
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    sim = (z @ z.T / TAU).fill_diagonal_(float("-inf"))
    n = len(z1)
    return F.cross_entropy(sim, torch.cat([torch.arange(n, 2 * n), torch.arange(n)]).to(z.device))


def batches(data, batch_size, epoch, start, seed):
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    order = torch.randperm(len(data), generator=g)
    for b in range(start, -(-len(data) // batch_size)):
        i = order[b * batch_size:(b + 1) * batch_size]
        yield (data.images[i].float() / 255 - 0.3) / 0.3, digit_of(data.labels[i])


def phase(folder, modules, params, lr, epochs, batch_size, train, loss_fn, val=None):
    fabric = Fabric(accelerator="cpu", loggers=TensorBoardLogger(folder))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(params, lr))
    modules = {name: fabric.setup_module(m) for name, m in modules.items()}
    state = {**modules, "optimizer": optimizer, "step": 0, "rng": torch.get_rng_state(),
             "acc": None}
    if os.path.exists(f"{folder}/last.ckpt"):
        fabric.load(f"{folder}/last.ckpt", state)
        torch.set_rng_state(state["rng"])
    per_epoch = -(-len(train) // batch_size)
    while state["step"] < epochs * per_epoch:
        epoch, start = divmod(state["step"], per_epoch)
        for x, y in batches(train, batch_size, epoch, start, seed=1 + (val is not None)):
            loss = loss_fn(modules, x.to(fabric.device), y.to(fabric.device))
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            state["step"] += 1
            fabric.log("train/loss", loss.item(), state["step"])
            if val is not None and state["step"] % per_epoch == 0:
                state["acc"] = val(fabric, modules)
                fabric.log("val/acc", state["acc"], state["step"])
            if state["step"] % 16 == 0 or STOP["signal"]:
                state["rng"] = torch.get_rng_state()
                fabric.save(f"{folder}/last.ckpt", state)
            if STOP["signal"]:
                sys.exit(75)
    return state["acc"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", default="runs/simclr")
    parser.add_argument("--pretrain-epochs", type=int, default=6)
    parser.add_argument("--probe-epochs", type=int, default=3)
    args = parser.parse_args()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, lambda signum, frame: STOP.update(signal=signum))
    train, val = digits(2048, seed=1), digits(512, seed=2)
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Flatten(), nn.Linear(SIZE * SIZE, 256), nn.ReLU(),
                            nn.Linear(256, 64))
    head = nn.Sequential(nn.ReLU(), nn.Linear(64, 32))
    probe = nn.Linear(64, CLASSES)

    def contrastive(m, x, y):
        return nt_xent(m["head"](m["encoder"](augment(x))), m["head"](m["encoder"](augment(x))))

    def probing(m, x, y):
        with torch.no_grad():
            features = m["encoder"](x)
        return F.cross_entropy(m["probe"](features), y)

    def accuracy(fabric, m):
        acc = MulticlassAccuracy(CLASSES).to(fabric.device)
        m["probe"].eval()
        with torch.no_grad():
            for i in range(0, len(val), 256):
                x = ((val.images[i:i + 256].float() / 255 - 0.3) / 0.3).to(fabric.device)
                acc.update(m["probe"](m["encoder"](x)), digit_of(val.labels[i:i + 256]))
        m["probe"].train()
        return acc.compute().item()

    phase(f"{args.run_dir}/pretrain", {"encoder": encoder, "head": head},
          [*encoder.parameters(), *head.parameters()], 4e-3, args.pretrain_epochs, 128, train,
          contrastive)
    if STOP["signal"]:
        sys.exit(75)
    encoder.eval()
    acc = phase(f"{args.run_dir}/probe", {"probe": probe, "encoder": encoder},
                probe.parameters(), 1e-2, args.probe_epochs, 64, train, probing, accuracy)
    print(f"linear probe val/acc {acc:.4f}")


if __name__ == "__main__":
    main()
