"""Activation checkpointing policies on the built-in GPT: memory held for backward, step time.

    python -m benchmarks.activation_policies      # off, full and selective, sides alternating
    python -m benchmarks.activation_policies --quick

``+exp=lm``'s GPT (dim 128, 4 layers, 4 heads, 256 tokens of context, batch 32 by default)
trains steps under each ``trainer.activation_checkpointing`` policy: off, ``full`` and
``selective`` (each block's matmul and attention outputs kept, the rest recomputed). Two
figures per policy, all three models in one process, the sides alternating (off, full,
selective, selective, full, off) in each round:

- the activation memory: how far the forward raised the memory in use, read just before the
  backward -- on the CPU the C heap's bytes in use (glibc's ``mallinfo2``: torch's CPU tensors
  live there, freed blocks do not count), on CUDA ``torch.cuda.memory_allocated``. Exact on
  CUDA, within a few KiB of Python's own objects on the CPU;
- the step time: forward and backward of one batch (synchronised on CUDA).

Ratios: selective / off memory (goal < 1), selective / full step time (goal < 1: selective
recomputes only the cheap ops), full / selective memory (context).
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import time
from collections.abc import Callable

import torch
from torch import nn

from benchmarks.common import alternate, emit, median, ratio, row
from trainkit.loop.activations import apply_activation_checkpointing
from trainkit.models.gpt import GPT

POLICIES = ("off", "full", "selective")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def memory_in_use(device: torch.device) -> int:
    """Bytes in use now: torch's CUDA allocations, or the C heap's (glibc) on the CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        raise SystemExit("activation_policies on the CPU reads glibc's mallinfo2 (glibc 2.33+)")
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd  # small blocks handed out + mmapped (large) ones


def one_step(model: nn.Module, ids: torch.Tensor) -> tuple[int, float]:
    """``(bytes the forward held for backward, seconds of forward + backward)``."""
    device = ids.device
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started, before = time.perf_counter(), memory_in_use(device)
    loss = model(ids).float().logsumexp(-1).mean()
    held = memory_in_use(device) - before
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return held, time.perf_counter() - started


def _sides(args: argparse.Namespace) -> tuple[dict[str, Callable[[], float]],
                                              dict[str, list[float]]]:
    """One model per policy (the same weights): a side per policy that trains one step and
    returns its seconds, and where each side puts the bytes its forward held."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    base = GPT(dim=args.dim, layers=args.layers, heads=args.heads, block=args.seq).to(device)
    ids = torch.randint(0, 256, (args.batch, args.seq), device=device)
    found: dict[str, list[float]] = {policy: [] for policy in POLICIES}
    sides = {}
    for policy in POLICIES:
        model = copy.deepcopy(base)
        if policy != "off":
            apply_activation_checkpointing(model, policy)
        one_step(model, ids)  # warm-up: the allocator's first requests

        def side(model: nn.Module = model, policy: str = policy) -> float:
            held, seconds = one_step(model, ids)
            found[policy].append(float(held))
            return seconds

        sides[policy] = side
    return sides, found


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.dim, args.layers, args.seq, args.batch, args.rounds = 32, 2, 32, 4, 1
    sides, found = _sides(args)
    times = alternate(sides, args.rounds)
    # as alternate's samples: each round's two measurements of a side together
    memory = {policy: [found[policy][i:i + 2] for i in range(0, len(found[policy]), 2)]
              for policy in POLICIES}
    result = {
        "benchmark": "activation_policies",
        "device": args.device,
        "measure": ("memory_allocated" if args.device.startswith("cuda")
                    else "C heap in use (mallinfo2)"),
        **{f"{policy}_activation_mib": median(memory, policy) / 2**20 for policy in POLICIES},
        **{f"{policy}_step_ms": 1000 * median(times, policy) for policy in POLICIES},
        "selective_vs_off_memory": ratio(memory, "selective", "off"),
        "full_vs_selective_memory": ratio(memory, "full", "selective"),
        "selective_vs_full_time": ratio(times, "selective", "full"),
        "selective_vs_off_time": ratio(times, "selective", "off"),
        "dim": args.dim, "layers": args.layers, "heads": args.heads, "seq": args.seq,
        "batch": args.batch, "rounds": args.rounds,
    }
    result["rows"] = [
        row("selective checkpointing: activation memory / off", result[
            "selective_vs_off_memory"], "< 1 (memory)", result["selective_vs_off_memory"] < 1),
        row("selective checkpointing: step time / full", result["selective_vs_full_time"],
            "< 1 (time)", result["selective_vs_full_time"] < 1),
    ]
    emit(result)
    return result


if __name__ == "__main__":
    main()
