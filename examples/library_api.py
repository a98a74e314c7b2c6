"""Research code using trainkit as a library: your model, your data, your loss; no Hydra.

    python examples/library_api.py --run-dir runs/regression

Trains a small MLP on a synthetic regression problem through trainkit's DataLoader factory
(``make_loader``: a torch DataLoader that can restart mid-epoch) and reports mean absolute error
from torchmetrics. Re-running the same command with the same
--run-dir resumes from its last checkpoint instead of starting over. Stopped by a signal
(Ctrl-C, SIGTERM from a scheduler, ...), it saves, then exits with status 75 as the entry point
does, so a requeue loop knows to run it again.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanAbsoluteError

from trainkit import (
    EXIT_PREEMPTED,
    CheckpointConfig,
    Trainer,
    TrainerConfig,
    make_loader,
    seed_everything,
)


def make_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) - x[:, 4:].prod(dim=1, keepdim=True)).tanh()
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/library_api")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--precision", default="32", choices=["32", "bf16-mixed", "16-mixed"])
    args = parser.parse_args()

    seed_everything(0)
    # Resumable mid-epoch (a plain shuffled DataLoader can only resume at epoch ends); no
    # workers: these samples are tensors in memory, workers would only add overhead.
    train = make_loader(make_data(4096, seed=1), 64, shuffle=True, num_workers=0)
    val = DataLoader(make_data(1024, seed=2), batch_size=256)
    model = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    trainer = Trainer(
        TrainerConfig(max_epochs=args.epochs, precision=args.precision, device="auto", seed=0,
                      gradient_clip_val=1.0, accumulate_grad_batches=2, log_every_n_steps=16),
        run_dir=args.run_dir,
        checkpoint=CheckpointConfig(every_n_steps=32, keep_last=2),
    )
    summary = trainer.fit(
        model, optimizer, train, val_data=val,
        criterion=nn.functional.mse_loss,
        metrics={"mae": MeanAbsoluteError()},
    )
    if summary["status"] == "preempted":  # saved; metrics only if an evaluation already ran
        print(f"stopped at step {summary['global_step']}; re-run the same command to resume")
        sys.exit(EXIT_PREEMPTED)
    print(f"val/mae {summary['metrics']['val/mae']:.4f} after {summary['global_step']} steps")


if __name__ == "__main__":
    main()
