"""FSDP vs DDP: the bytes of parameters, gradients and optimizer state each rank holds.

    python -m benchmarks.fsdp_memory           # ratio = FSDP / DDP bytes per rank, 2 ranks
    python -m benchmarks.fsdp_memory --quick

A model dominated by large layers (a stack of square Linear layers) takes one AdamW step on
2 ranks (torchrun, gloo, CPU), once under DDP (``distributed.wrap_ddp``) and once under FSDP
(``fsdp.shard_model``), each on a fresh model, in one torchrun job. Each rank then counts the
bytes of the tensors it stores: its parameters (its shards under FSDP), their gradients (after
backward) and AdamW's two moments. These are counts of tensor storage, not timings, so one run
of each side is exact; the ratio should be about 1/world_size. DDP's gradient buckets (another
gradient-sized buffer for its all-reduce) and the activations are not counted.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from torch import nn

from benchmarks.common import emit, row, run_process

WORLD = 2


def _bytes(tensors: Any) -> int:
    from trainkit.distributed.fsdp import local

    return sum(local(t).numel() * t.element_size() for t in tensors if t is not None)


def worker(width: int, depth: int) -> None:
    """On each rank under torchrun: both sides, then rank 0 prints every rank's byte counts."""
    from trainkit import Runtime
    from trainkit.distributed import group

    runtime = Runtime.from_env("cpu")
    group.init_process_group(runtime)
    sides = {strategy: group.all_gather(_one_step(strategy, width, depth, runtime))
             for strategy in ("ddp", "fsdp")}
    if runtime.is_main:
        print(json.dumps(sides))
    group.shutdown()


def _one_step(strategy: str, width: int, depth: int, runtime: Any) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state after one AdamW step."""
    from trainkit.distributed import ddp, fsdp

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model = (fsdp.shard_model(model, optimizer, runtime) if strategy == "fsdp"
             else ddp.wrap_ddp(model, runtime))
    model(torch.randn(8, width)).square().mean().backward()
    params = list(ddp.unwrap(model).parameters())
    grads = _bytes(p.grad for p in params)
    optimizer.step()
    state = [v for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]  # not the step counters
    return {"params": _bytes(params), "grads": grads, "optimizer": _bytes(state)}


def _sides(args: argparse.Namespace) -> dict[str, list[dict[str, int]]]:
    """Per strategy, each rank's counts, from one torchrun job (both sides in one group)."""
    from trainkit.distributed.torchrun import torchrun_command

    command = torchrun_command(["--worker", "--width", str(args.width), "--depth", str(args.depth)],
                               nproc=WORLD, module="benchmarks.fsdp_memory")
    _, out = run_process(command)
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.width, args.depth)
        return {}
    if args.quick:
        args.width, args.depth = 256, 2
    sides = _sides(args)
    ddp, sharded = sides["ddp"], sides["fsdp"]
    per_rank = {name: [sum(r.values()) for r in ranks]
                for name, ranks in (("ddp", ddp), ("fsdp", sharded))}
    value = max(per_rank["fsdp"]) / max(per_rank["ddp"])
    result = {
        "benchmark": "fsdp_memory", "world_size": WORLD, "width": args.width,
        "depth": args.depth, "ddp_per_rank": ddp, "fsdp_per_rank": sharded,
        "ddp_mib_per_rank": max(per_rank["ddp"]) / 2**20,
        "fsdp_mib_per_rank": max(per_rank["fsdp"]) / 2**20, "ratio": value,
        "goal": f"ratio ~ 1/world_size = {1 / WORLD:.2f} (<= {1 / WORLD + 0.05:.2f})",
    }
    result["rows"] = [row("fsdp: param+grad+optim bytes/rank vs ddp", value,
                          f"~1/{WORLD} (<= {1 / WORLD + 0.05:.2f})", value <= 1 / WORLD + 0.05)]
    emit(result)
    return result


if __name__ == "__main__":
    main()
