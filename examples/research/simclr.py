"""SimCLR-style contrastive pre-training, then a linear probe: two phases in one script.

    python examples/research/simclr.py --run-dir runs/simclr

Phase 1 (``pretrain/``) trains an encoder and a projection head on NT-Xent between two augmented
views of each image, labels unused; phase 2 (``probe/``) trains a linear classifier on the frozen
encoder's features. Under ``trainkit.preemptible()`` a signal anywhere stops the script with exit
status 75, and the same command resumes it, skipping a finished phase. NT-Xent compares the
samples of a batch with each other, so phase 1 says ``in_batch_loss=True``: trainkit then
refuses to split its batches into micro-batches (docs/training.md, "In-batch losses").
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from digits import CLASSES, SIZE, digit_of, digits
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

import trainkit
from trainkit import CheckpointConfig, InMemoryLoader, Trainer, TrainerConfig

TAU = 0.2


def augment(x: torch.Tensor) -> torch.Tensor:  # draws from training's random stream
    shifted = torch.stack([x.roll(s, 3) for s in (-1, 0, 1)])  # each sample shifted at random
    x = shifted[torch.randint(0, 3, (len(x),), device=x.device), torch.arange(len(x))]
    return (x + 0.3 * torch.randn_like(x)) * (torch.rand_like(x) > 0.1)


def nt_xent(z1: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    sim = (z @ z.T / TAU).fill_diagonal_(float("-inf"))
    n = len(z1)
    return F.cross_entropy(sim, torch.cat([torch.arange(n, 2 * n), torch.arange(n)]).to(z.device))


def pretrain_step(ctx: trainkit.StepContext, batch) -> None:
    encoder, head = ctx.models["encoder"], ctx.models["head"]
    x = batch[0]
    ctx.optimize("encoder", nt_xent(head(encoder(augment(x))), head(encoder(augment(x)))))


def probe_step(ctx: trainkit.StepContext, batch) -> None:
    with torch.no_grad():
        features = ctx.models["encoder"](batch[0])
    ctx.optimize("probe", F.cross_entropy(ctx.models["probe"](features), digit_of(batch[1])))


def evaluate_probe(ctx: trainkit.EvalContext, batch):
    return ctx.models["probe"](ctx.models["encoder"](batch[0])), digit_of(batch[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/simclr")
    parser.add_argument("--pretrain-epochs", type=int, default=6)
    parser.add_argument("--probe-epochs", type=int, default=3)
    args = parser.parse_args()
    with trainkit.preemptible():
        train, val = digits(2048, seed=1), digits(512, seed=2)
        checkpoint = CheckpointConfig(every_n_steps=16, keep_last=2)
        torch.manual_seed(0)
        encoder = nn.Sequential(nn.Flatten(), nn.Linear(SIZE * SIZE, 256), nn.ReLU(),
                                nn.Linear(256, 64))
        head = nn.Sequential(nn.ReLU(), nn.Linear(64, 32))
        probe = nn.Linear(64, CLASSES)
        params = [*encoder.parameters(), *head.parameters()]
        Trainer(TrainerConfig(max_epochs=args.pretrain_epochs, device="cpu", in_batch_loss=True,
                              log_every_n_steps=16),
                run_dir=f"{args.run_dir}/pretrain", checkpoint=checkpoint).fit(
            {"encoder": encoder, "head": head}, {"encoder": torch.optim.Adam(params, 4e-3)},
            InMemoryLoader(train, 128, shuffle=True, seed=1), step=pretrain_step)
        probed = Trainer(TrainerConfig(max_epochs=args.probe_epochs, device="cpu",
                                       log_every_n_steps=16),
                         run_dir=f"{args.run_dir}/probe", checkpoint=checkpoint).fit(
            {"probe": probe, "encoder": encoder}, {"probe": torch.optim.Adam(probe.parameters(),
                                                                              1e-2)},
            InMemoryLoader(train, 64, shuffle=True, seed=2), step=probe_step,
            val_data=InMemoryLoader(val, 256, shuffle=False), evaluate=evaluate_probe,
            metrics={"acc": MulticlassAccuracy(CLASSES)})
        print(f"linear probe val/acc {probed['metrics']['val/acc']:.4f}")


if __name__ == "__main__":
    main()
