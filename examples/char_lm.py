"""A byte-level transformer language model (nanoGPT's shape, tiny) trained through ``Trainer.fit``.

    python examples/char_lm.py --run-dir runs/char_lm                 # the stdlib's .py files
    python examples/char_lm.py --run-dir runs/lm --files a.txt b.txt  # your own text
    torchrun --nproc_per_node=2 examples/char_lm.py --run-dir runs/lm_ddp --device cpu

Research code that is not image classification, in trainkit's terms: dict batches
(``{"tokens": ...}``) and a ``forward`` of its own that also returns a scalar of its own (the
z-loss, logged as ``train/z_loss``); evaluation every ``--eval-every`` steps on at most
``--eval-batches`` batches, with perplexity as a metric; a callback that prints a short sample
after each evaluation (rank 0 only) and keeps its random stream in the checkpoints; early stopping
on ``val/loss``. By default it reads the Python standard library's own ``.py`` sources, so it runs
offline anywhere. Re-running the same command resumes (exit status 75 means: preempted, run it
again); a run stopped early, or completed, exits 0.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
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
    seed_everything,
)
from trainkit.distributed.group import sum_across_ranks
from trainkit.errors import print_error
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


# -- model --------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class ByteGPT(nn.Module):
    """A GPT over bytes (256 tokens): embeddings, causal blocks, a tied output layer."""

    def __init__(self, block: int = 128, dim: int = 128, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.block = block
        self.tokens, self.positions = nn.Embedding(256, dim), nn.Embedding(block, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        for param in self.parameters():  # GPT-2's small initial weights (also the output layer's)
            if param.dim() > 1:
                nn.init.normal_(param, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        return self.ln(self.blocks(x)) @ self.tokens.weight.T  # logits (batch, time, 256)


def forward(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple[Any, ...]:
    """Next-byte logits and targets, and a scalar of our own: the z-loss (PaLM's), how far the
    softmax's log-normalizer drifts from 0; logged as train/z_loss, averaged on the device."""
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    z_loss = torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
    return logits, tokens[:, 1:], {"z_loss": z_loss}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Perplexity:
    """exp(mean next-byte loss) over an evaluation, summed over ranks (a torchmetrics-like metric:
    ``torchmetrics.text.Perplexity`` does the same, at ~2 s more import time)."""

    def to(self, device: torch.device) -> Perplexity:
        return self

    def reset(self) -> None:
        self.nll, self.count = 0.0, 0

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        self.nll = self.nll + F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                              reduction="sum")
        self.count += targets.numel()

    def compute(self) -> float:
        nll, count = sum_across_ranks(self.nll, self.count)
        return math.exp(nll / max(count, 1))


# -- a callback ---------------------------------------------------------------------------------


class PrintSample:
    """After each evaluation, rank 0 prints a few bytes the model writes after ``prompt``.

    Stateful: its random stream and count are in every checkpoint (``state_key``), so a resumed
    run prints what the uninterrupted one would. Callbacks run on every rank: this one acts on
    rank 0 only.
    """

    state_key = "sample"

    def __init__(self, model: nn.Module, prompt: bytes = b"def ", length: int = 60) -> None:
        self.model, self.prompt, self.length = model, prompt, length
        self.generator = torch.Generator().manual_seed(0)
        self.printed = 0

    def on_evaluation_end(self, trainer: Trainer, results: Mapping[str, float],
                          step: int) -> None:
        if not trainer.runtime.is_main:
            return
        text = generate(self.model, self.prompt, self.length, self.generator)
        self.printed += 1
        print(f"sample at step {step}: {text!r}", flush=True)

    def state_dict(self) -> dict[str, Any]:
        return {"printed": self.printed, "generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.printed = int(state["printed"])
        self.generator.set_state(state["generator"])


@torch.no_grad()
def generate(model: nn.Module, prompt: bytes, length: int, generator: torch.Generator) -> str:
    """``length`` bytes sampled after ``prompt`` (temperature 1)."""
    was_training, device = model.training, next(model.parameters()).device
    model.eval()
    ids = torch.tensor([list(prompt)], device=device)
    for _ in range(length):
        probs = model(ids[:, -model.block:])[0, -1].float().softmax(-1).cpu()
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator).to(device)[None]],
                        dim=1)
    model.train(was_training)
    return bytes(ids[0].tolist()).decode("utf-8", errors="replace")


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
    model = ByteGPT(args.block, args.dim, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    trainer = Trainer(
        TrainerConfig(max_epochs=1000, max_steps=args.steps, precision=args.precision,
                      device=str(runtime.device), seed=args.seed, gradient_clip_val=1.0,
                      log_every_n_steps=args.log_every, eval_every_n_steps=args.eval_every,
                      eval_max_batches=args.eval_batches, ema_decay=args.ema),
        run_dir=args.run_dir, runtime=runtime,
        checkpoint=CheckpointConfig(every_n_steps=args.checkpoint_every, monitor="val/loss",
                                    mode="min"),
        callbacks=[PrintSample(model), EarlyStopping("val/loss", patience=args.patience,
                                                    min_delta=args.min_delta),
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
