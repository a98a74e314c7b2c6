"""A GAN with two models and two optimizers on an 8-mode 2-D Gaussian mixture.

    python examples/research/gan.py --run-dir runs/gan

Your step alternates the updates: the discriminator on real and (detached) fake points, then
the generator through the discriminator, which gets no gradient from that loss (``frozen``).
Both models, both optimizers and the loss scaler are checkpointed by name and resume bit for bit;
a NaN in one loss skips that optimizer's step only. Each evaluation samples the generator on its
own random stream and logs how many of the 8 modes it covers (``val/modes``) and the share of
its points near a mode (``val/good``). Under ``trainkit.preemptible()`` a signal stops the
script with exit status 75; the same command resumes it.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

import trainkit
from trainkit import CheckpointConfig, Trainer, TrainerConfig
from trainkit.data import ResumableLoader

Z, MODES, RADIUS, STD = 2, 8, 2.0, 0.05
CENTERS = torch.tensor([[RADIUS * math.cos(2 * math.pi * k / MODES),
                         RADIUS * math.sin(2 * math.pi * k / MODES)] for k in range(MODES)])


class Mixture(ResumableLoader):
    """Batches of points from the mixture; batch ``b`` of epoch ``e`` is a function of (e, b),
    so the loader starts at any batch (trainkit's resume protocol)."""

    def __init__(self, batches: int, batch_size: int, seed: int) -> None:
        self.batches, self.batch_size, self.seed = batches, batch_size, seed

    def __len__(self) -> int:
        return self.batches

    def _pass(self, epoch: int, start: int):
        for b in range(start, self.batches):
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch * 10_007 + b)
            mode = torch.randint(0, MODES, (self.batch_size,), generator=g)
            yield (CENTERS[mode] + STD * torch.randn(self.batch_size, 2, generator=g),)


def mlp(inputs: int, outputs: int) -> nn.Module:
    return nn.Sequential(nn.Linear(inputs, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, outputs))


def gan_step(ctx: trainkit.StepContext, batch) -> None:
    real, d = batch[0], ctx.models["d"]
    fake = ctx.models["g"](torch.randn(len(real), Z, device=real.device))
    d_real, d_fake = d(real), d(fake.detach())
    ctx.optimize("d", F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real))
                 + F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake)))
    d_out = d(fake)
    ctx.optimize("g", F.binary_cross_entropy_with_logits(d_out, torch.ones_like(d_out)),
                 frozen=["d"])
    ctx.log(d_real=torch.sigmoid(d_real).mean(), d_fake=torch.sigmoid(d_fake).mean())


def gan_eval(ctx: trainkit.EvalContext, batch):
    fake = ctx.models["g"](torch.randn(len(batch[0]), Z, device=batch[0].device)).float()
    distance, nearest = torch.cdist(fake, CENTERS.to(fake.device)).min(dim=1)
    good = distance < 4 * STD
    counts = torch.bincount(nearest[good], minlength=MODES)
    ctx.log(modes=(counts >= 0.02 * len(fake)).sum(), good=good.float().mean())
    return fake, batch[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/gan")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--precision", default="32", choices=["32", "bf16-mixed", "16-mixed"])
    args = parser.parse_args()
    with trainkit.preemptible():
        torch.manual_seed(0)
        g, d = mlp(Z, 2), mlp(2, 1)
        config = TrainerConfig(max_steps=args.steps, precision=args.precision, device="auto",
                               log_every_n_steps=250, eval_every_n_steps=500)
        summary = Trainer(config, run_dir=args.run_dir,
                          checkpoint=CheckpointConfig(every_n_steps=250, keep_last=2)).fit(
            {"g": g, "d": d},
            {"g": torch.optim.Adam(g.parameters(), 5e-4, betas=(0.5, 0.9)),
             "d": torch.optim.Adam(d.parameters(), 1e-3, betas=(0.5, 0.9))},
            Mixture(args.steps, 256, seed=1), step=gan_step,
            val_data=Mixture(1, 2048, seed=2), evaluate=gan_eval)
        print(f"modes covered {summary['metrics']['val/modes']:.0f} of {MODES}, points near a "
              f"mode {summary['metrics']['val/good']:.3f}")


if __name__ == "__main__":
    main()
