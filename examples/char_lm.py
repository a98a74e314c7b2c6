"""A byte-level transformer language model (nanoGPT's shape, tiny) trained through ``Trainer.fit``.

    python examples/char_lm.py --run-dir runs/char_lm                 # the stdlib's .py files
    python examples/char_lm.py --run-dir runs/lm --files a.txt b.txt  # your own text
    torchrun --nproc_per_node=2 examples/char_lm.py --run-dir runs/lm_ddp --device cpu

Research code that is not image classification, in trainkit's terms (the model and its parts are
trainkit's, :mod:`trainkit.models.gpt`; ``python -m trainkit.train +exp=lm`` trains the same
model on a token corpus from the entry point): dict batches (``{"tokens": ...}``) and a
``forward`` of its own that also returns a scalar of its own (the z-loss, logged as
``train/z_loss``); evaluation every ``--eval-every`` steps on at most
``--eval-batches`` batches, with perplexity as a metric; a callback that prints a short sample
after each evaluation (rank 0 only) and keeps its random stream in the checkpoints; early stopping
on ``val/loss``. By default it reads the Python standard library's own ``.py`` sources, so it runs
offline anywhere. Re-running the same command resumes (exit status 75 means: preempted, run it
again); a run stopped early, or completed, exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from trainkit import (
    EXIT_PREEMPTED,
    CheckpointConfig,
    EarlyStopping,
    Runtime,
    Trainer,
    TrainerConfig,
    TrainkitError,
    make_loader,
    param_groups,
    seed_everything,
)
from trainkit.core.errors import print_error
from trainkit.models import GPT, Perplexity, PrintSample, lm_forward, lm_loss
from trainkit.observe.logging import log_to_file

# -- data ---------------------------------------------------------------------------------------


def read_bytes(files: Sequence[str], max_bytes: int) -> torch.Tensor:
    """The files' bytes, concatenated (at most ``max_bytes``), as a uint8 tensor."""
    chunks, total = [], 0
    for name in files:
        data = Path(name).read_bytes()[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 1024:
        raise TrainkitError(f"only {total} bytes of text in {len(files)} files: give --files "
                            "with more text")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def stdlib_sources() -> list[str]:
    """The standard library's top-level ``.py`` files, in a fixed order."""
    return sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


class Chunks(Dataset):
    """Non-overlapping windows of ``block + 1`` bytes: inputs and their next bytes."""

    def __init__(self, data: torch.Tensor, block: int) -> None:
        self.data, self.block = data, block

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = i * self.block
        return {"tokens": self.data[start:start + self.block + 1].long()}


# -- model: trainkit's small GPT, its forward (with the z-loss), loss, perplexity, sample callback


forward = lm_forward  # what Trainer.fit calls with (model, batch); tests replace it


# -- the run ------------------------------------------------------------------------------------


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default="runs/char_lm")
    p.add_argument("--files", nargs="*", help="text files (default: the stdlib's .py files)")
    p.add_argument("--max-bytes", type=int, default=4_000_000)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--patience", type=int, default=3, help="early stopping: evaluations")
    p.add_argument("--min-delta", type=float, default=0.0, help="early stopping: least gain")
    p.add_argument("--checkpoint-every", type=int, default=200)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--precision", default="32", choices=["32", "bf16-mixed", "16-mixed"])
    p.add_argument("--ema", type=float, default=None, help="EMA decay, e.g. 0.999")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def train(args: argparse.Namespace, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Build the data, model and trainer from ``args`` and fit; ``callbacks`` are added."""
    runtime = Runtime.from_env(args.device)
    data = read_bytes(args.files or stdlib_sources(), args.max_bytes)
    split = int(0.9 * len(data))
    loader = {"batch_size": args.batch_size, "device": runtime.device, "seed": args.seed,
              "rank": runtime.rank, "world_size": runtime.world_size,
              "num_workers": args.workers}
    train_data = make_loader(Chunks(data[:split], args.block), shuffle=True, drop_last=True,
                             **loader)
    val_data = make_loader(Chunks(data[split:], args.block), shuffle=False,
                           **{**loader, "num_workers": 0})
    seed_everything(args.seed)  # the same initial weights on every rank
    model = GPT(vocab_size=256, block=args.block, dim=args.dim, layers=args.layers)
    # GPT-2's recipe: weight decay on the 2-D weights only (not biases, norms, embeddings)
    optimizer = torch.optim.AdamW(param_groups(model, decay_norm_and_bias=False), lr=args.lr,
                                  weight_decay=0.1)
    trainer = Trainer(
        TrainerConfig(max_epochs=1000, max_steps=args.steps, precision=args.precision,
                      device=str(runtime.device), seed=args.seed, gradient_clip_val=1.0,
                      log_every_n_steps=args.log_every, eval_every_n_steps=args.eval_every,
                      eval_max_batches=args.eval_batches, ema_decay=args.ema),
        run_dir=args.run_dir, runtime=runtime,
        checkpoint=CheckpointConfig(every_n_steps=args.checkpoint_every, monitor="val/loss",
                                    mode="min"),
        callbacks=[PrintSample(model, prompt="def "),
                   EarlyStopping("val/loss", patience=args.patience, min_delta=args.min_delta),
                   *callbacks],
    )
    return trainer.fit(model, optimizer, train_data, val_data=val_data, criterion=lm_loss,
                       forward=forward, metrics={"perplexity": Perplexity()})


def main(argv: Sequence[str] | None = None, callbacks: Sequence[Any] = ()) -> None:
    """Train; exit 75 when preempted (re-run to resume), 2 with one line on bad input."""
    args = parse(argv)
    try:
        summary = train(args, callbacks)
    except TrainkitError as err:
        log_to_file(print_error(str(err), err.details))
        sys.exit(2)
    if summary["status"] == "preempted":
        sys.exit(EXIT_PREEMPTED)
    metrics = summary["metrics"]
    if metrics and os.environ.get("RANK", "0") == "0":
        print(f"{summary['status']} at step {summary['global_step']}: val/loss "
              f"{metrics['val/loss']:.3f}, perplexity {metrics['val/perplexity']:.2f}"
              + (f" ({summary['stop_reason']})" if summary.get("stop_reason") else ""))


if __name__ == "__main__":
    main()
