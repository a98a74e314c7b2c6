"""examples/research/gan.py written with Lightning Fabric, for the line count in
docs/research.md ("Your own step"). Not run here: lightning is not installed in this project.

The same program: two models, two optimizers, alternating updates, resumable mid-run, a SIGTERM
saving a checkpoint and exiting 75, mode coverage measured on an evaluation stream of its own.
"""

import argparse
import math
import os
import signal
import sys

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.loggers import TensorBoardLogger
from torch import nn

Z, MODES, RADIUS, STD = 2, 8, 2.0, 0.05
CENTERS = torch.tensor([[RADIUS * math.cos(2 * math.pi * k / MODES),
                         RADIUS * math.sin(2 * math.pi * k / MODES)] for k in range(MODES)])
STOP = {"signal": None}


def mixture(batch_size, seed, b):
    g = torch.Generator().manual_seed(seed * 1_000_003 + b)
    mode = torch.randint(0, MODES, (batch_size,), generator=g)
    return CENTERS[mode] + STD * torch.randn(batch_size, 2, generator=g)


def mlp(inputs, outputs):
    return nn.Sequential(nn.Linear(inputs, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, outputs))


def coverage(fabric, g, step):
    training_rng = torch.get_rng_state()
    torch.manual_seed(step)  # an evaluation stream of its own: training's is put back
    g.eval()
    with torch.no_grad():
        fake = g(torch.randn(2048, Z, device=fabric.device)).float()
    g.train()
    torch.set_rng_state(training_rng)
    distance, nearest = torch.cdist(fake, CENTERS.to(fake.device)).min(dim=1)
    good = distance < 4 * STD
    counts = torch.bincount(nearest[good], minlength=MODES)
    return int((counts >= 0.02 * len(fake)).sum()), good.float().mean().item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", default="runs/gan")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--precision", default="32-true")
    args = parser.parse_args()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, lambda signum, frame: STOP.update(signal=signum))
    fabric = Fabric(precision=args.precision, loggers=TensorBoardLogger(args.run_dir))
    torch.manual_seed(0)
    g, d = mlp(Z, 2), mlp(2, 1)
    opt_g = torch.optim.Adam(g.parameters(), 5e-4, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(d.parameters(), 1e-3, betas=(0.5, 0.9))
    g, opt_g = fabric.setup(g, opt_g)
    d, opt_d = fabric.setup(d, opt_d)
    state = {"g": g, "d": d, "opt_g": opt_g, "opt_d": opt_d, "step": 0,
             "rng": torch.get_rng_state(), "modes": 0, "good": 0.0}
    checkpoint = f"{args.run_dir}/last.ckpt"
    if os.path.exists(checkpoint):
        fabric.load(checkpoint, state)
        torch.set_rng_state(state["rng"])
    while state["step"] < args.steps:
        real = mixture(256, 1, state["step"]).to(fabric.device)
        fake = g(torch.randn(len(real), Z, device=fabric.device))
        d_real, d_fake = d(real), d(fake.detach())
        loss_d = (F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real))
                  + F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake)))
        opt_d.zero_grad()
        fabric.backward(loss_d)
        opt_d.step()
        with fabric.no_backward_sync(d, enabled=False):
            d.requires_grad_(False)
            d_out = d(fake)
            loss_g = F.binary_cross_entropy_with_logits(d_out, torch.ones_like(d_out))
            opt_g.zero_grad()
            fabric.backward(loss_g)
            opt_g.step()
            d.requires_grad_(True)
        state["step"] += 1
        if state["step"] % 250 == 0:
            fabric.log_dict({"train/loss_d": loss_d.item(), "train/loss_g": loss_g.item(),
                             "train/d_real": torch.sigmoid(d_real).mean().item(),
                             "train/d_fake": torch.sigmoid(d_fake).mean().item()}, state["step"])
        if state["step"] % 500 == 0 or state["step"] == args.steps:
            state["modes"], state["good"] = coverage(fabric, g, state["step"])
            fabric.log_dict({"val/modes": state["modes"], "val/good": state["good"]},
                            state["step"])
        if state["step"] % 250 == 0 or STOP["signal"]:
            state["rng"] = torch.get_rng_state()
            fabric.save(checkpoint, state)
        if STOP["signal"]:
            sys.exit(75)
    print(f"modes covered {state['modes']} of {MODES}, points near a mode {state['good']:.3f}")


if __name__ == "__main__":
    main()
