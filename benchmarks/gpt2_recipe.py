"""``python -m benchmarks.gpt2_recipe``: +exp=lm's GPT with GPT-2's recipe against before it.

Before: PyTorch's default biases, every weight N(0, 0.02), AdamW decaying every parameter.
After (``trainkit.models.GPT`` and ``optim.decay_norm_and_bias=false``): zero biases, the
residual projections at 0.02 / sqrt(2 layers), weight decay on the 2-D weights only. Both train
the same steps on the same batches of a real corpus, this Python's own standard-library sources
as bytes (90% to train, the rest to validate), with ``+exp=lm``'s optimizer settings (AdamW lr
2e-3, weight decay 0.1, clipping 1.0, warm-up then cosine). Each seed runs both sides, in
alternating order; the figure is the validation loss (nats per byte) after the last step.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sysconfig
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainkit.models import GPT
from trainkit.models.param_groups import param_groups


def corpus(limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``limit`` bytes of the standard library's ``*.py`` files, in name order, split
    90/10 into training and validation tokens."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    data = bytearray()
    for file in files:
        data += file.read_bytes()
        if len(data) >= limit:
            break
    tokens = torch.frombuffer(data[:limit], dtype=torch.uint8).long()
    cut = int(len(tokens) * 0.9)
    return tokens[:cut], tokens[cut:]


def before(model: GPT) -> GPT:
    """The GPT as trainkit built it before the recipe: PyTorch's default linear layers, then
    every weight of 2 or more dimensions N(0, 0.02)."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()
    for param in model.parameters():
        if param.dim() > 1:
            nn.init.normal_(param, std=0.02)
    return model


def train(side: str, seed: int, data: tuple[torch.Tensor, torch.Tensor], args: Any) -> float:
    """Validation loss after ``args.steps`` steps of one side."""
    train_tokens, val_tokens = data
    torch.manual_seed(seed)
    model = GPT(256, args.seq, args.dim, args.layers, args.heads)
    if side == "before":
        model = before(model)
        groups: Any = model.parameters()
    else:
        groups = param_groups(model, decay_norm_and_bias=False)
    optimizer = torch.optim.AdamW(groups, lr=2e-3, weight_decay=0.1)
    warmup = max(1, args.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(
        (s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))
    g = torch.Generator().manual_seed(seed)  # the same batches for both sides
    for _ in range(args.steps):
        starts = torch.randint(0, len(train_tokens) - args.seq - 1, (args.batch,), generator=g)
        window = torch.stack([train_tokens[s:s + args.seq + 1] for s in starts.tolist()])
        loss = F.cross_entropy(model(window[:, :-1]).flatten(0, 1), window[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    model.eval()
    with torch.no_grad():
        cut = (len(val_tokens) - 1) // args.seq * args.seq
        x = val_tokens[:cut].view(-1, args.seq)[:args.val_windows]
        y = val_tokens[1:cut + 1].view(-1, args.seq)[:args.val_windows]
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny runs: check it works")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    args.batch, args.seq, args.dim, args.layers, args.heads = 16, 128, 128, 4, 4
    args.val_windows = 64
    if args.quick:
        args.seeds, args.steps, args.dim, args.layers, args.val_windows = 1, 3, 32, 2, 4
    torch.set_num_threads(1)
    data = corpus(2_000_000 if not args.quick else 50_000)
    losses: dict[str, list[float]] = {"before": [], "after": []}
    for seed in range(args.seeds):  # sides alternate: before first on even seeds
        for side in ("before", "after") if seed % 2 == 0 else ("after", "before"):
            losses[side].append(train(side, seed, data, args))
    result = {"val_loss": losses, "median": {k: statistics.median(v) for k, v in losses.items()},
              "steps": args.steps, "train_bytes": len(data[0]), "val_bytes": len(data[1])}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
