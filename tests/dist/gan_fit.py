"""One rank of the 2-rank GAN test (tests/dist/test_gan.py), started by torchrun.

Two models and two optimizers through ``step=`` under DDP (gloo), accumulating 2 batches per
step, beside a fixed model no optimizer holds: a run to the end (``<out>/full``), and one stopped
at step 5 then resumed (``<out>/cut``). Writes ``<out>/rank<R>.pt``: each run's final weights of
both models, and the types the step saw.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.spikes import ListLoader
from trainkit import CheckpointConfig, StepContext, Trainer, TrainerConfig
from trainkit.distributed import group

Z = 4
seen: dict[str, str] = {}


def models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {"g": nn.Sequential(nn.Linear(Z, 16), nn.Tanh(), nn.Linear(16, 2)),
            "d": nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1)),
            "prior": nn.Linear(Z, Z)}


def gan_step(ctx: StepContext, batch: Any) -> None:
    seen.update({name: type(model).__name__ for name, model in ctx.models.items()})
    real = batch[0]
    with torch.no_grad():
        z = ctx.models["prior"](torch.randn(len(real), Z, device=ctx.device))
    fake = ctx.models["g"](z)
    d = ctx.models["d"]
    d_real, d_fake = d(real), d(fake.detach())
    ctx.optimize("d", F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real))
                 + F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake)))
    out = d(fake)
    ctx.optimize("g", F.binary_cross_entropy_with_logits(out, torch.ones_like(out)),
                 frozen=["d"])
    ctx.log(d_real=d_real.mean())


def data(rank: int) -> ListLoader:
    g = torch.Generator().manual_seed(10 + rank)
    return ListLoader([(torch.randn(8, 2, generator=g) * 0.5 + 2, torch.zeros(8))
                       for _ in range(12)])


def fit(out: Path, rank: int, stop_at_step: int | None = None) -> dict[str, Any]:
    parts = models()
    opt_g = torch.optim.Adam(parts["g"].parameters(), lr=1e-2, betas=(0.5, 0.9))
    opt_d = torch.optim.SGD(parts["d"].parameters(), lr=1e-2, momentum=0.9)
    config = TrainerConfig(device="cpu", strategy="ddp", max_epochs=2, accumulate_grad_batches=2,
                           log_every_n_steps=2, log_every_n_seconds=0, hang_timeout_s=0,
                           gradient_clip_val=1.0)
    trainer = Trainer(config, run_dir=out, checkpoint=CheckpointConfig(every_n_steps=4))
    summary = trainer.fit(parts, {"g": opt_g, "d": opt_d}, data(rank), step=gan_step,
                          schedulers={"g": torch.optim.lr_scheduler.StepLR(opt_g, 2, 0.7)},
                          stop_at_step=stop_at_step)
    return {"summary": summary,
            "weights": {name: {k: v.detach().clone() for k, v in m.state_dict().items()}
                        for name, m in parts.items()}}


def main(out: Path) -> None:
    rank = int(os.environ["RANK"])
    results = {"full": fit(out / "full", rank)}
    results["stopped"] = fit(out / "cut", rank, stop_at_step=5)
    results["resumed"] = fit(out / "cut", rank)
    results["seen"] = dict(seen)
    torch.save(results, out / f"rank{rank}.pt")
    group.shutdown()  # before the interpreter exits (see tests/dist/micro_batch_fit.py)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
