"""Activation checkpointing: peak memory of a training step with and without it.

    python -m benchmarks.activation_memory           # ratio = checkpointed / plain peak growth
    python -m benchmarks.activation_memory --quick

A deep MLP of residual blocks (Linear-GELU-Linear) trains one step on a large batch. Each variant
runs in a fresh process (peak memory only grows within a process); the figure is how far the
step raised the peak above what the model and data already held: peak RSS on the CPU, torch's
``max_memory_allocated`` on CUDA. The variants alternate (plain, checkpointed, checkpointed,
plain); the ratio is the median over rounds of each round's ratio. Checkpointing keeps one input
per block and recomputes the rest in backward, so the ratio should be well below 1.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import alternate, emit, median, ratio, row
from trainkit.loop.activations import apply_activation_checkpointing

_PROC_STATUS, _PROC_CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def _reset_peak(device: torch.device) -> None:
    """Start the peak at what is held now, so that the import's own peak cannot hide the step's."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif _PROC_STATUS.is_file():
        _PROC_CLEAR_REFS.write_text("5")  # proc(5): "5" resets VmHWM to the current RSS


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    if _PROC_STATUS.is_file():
        # VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's peak (Linux keeps it
        # across fork and exec), so under the `python -m benchmarks` runner, which has held more
        # memory than this step needs, the growth read 0.
        line = next(x for x in _PROC_STATUS.read_text().splitlines() if x.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB, as on Linux


def one_step(checkpointed: bool, width: int, depth: int, batch: int, device: str) -> int:
    """In this process: the growth of peak memory over one forward/backward, in bytes."""
    dev = torch.device(device)
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(width) for _ in range(depth)]).to(dev)
    if checkpointed:
        apply_activation_checkpointing(model, ["Block"])
    x = torch.randn(batch, width, device=dev)
    _reset_peak(dev)
    before = _peak_bytes(dev)
    model(x).square().mean().backward()
    return _peak_bytes(dev) - before


def _in_subprocess(checkpointed: bool, args: argparse.Namespace) -> int:
    code = ("import sys; from benchmarks.activation_memory import one_step; "
            f"print(one_step({checkpointed}, {args.width}, {args.depth}, {args.batch}, "
            f"{args.device!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    return int(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.depth, args.batch, args.rounds = 512, 4, 2048, 1  # MiBs: RSS moves
    samples = alternate({"plain": lambda: _in_subprocess(False, args),
                         "checkpointed": lambda: _in_subprocess(True, args)}, args.rounds)
    result = {
        "benchmark": "activation_memory",
        "device": args.device,
        "measure": "max_memory_allocated" if args.device.startswith("cuda") else "peak RSS",
        "plain_step_peak_mib": median(samples, "plain") / 2**20,
        "checkpointed_step_peak_mib": median(samples, "checkpointed") / 2**20,
        "ratio": ratio(samples, "checkpointed", "plain"),
        "width": args.width, "depth": args.depth, "batch": args.batch, "rounds": args.rounds,
        "goal": "ratio < 1 (measurably lower peak memory)",
    }
    result["rows"] = [row("activation checkpointing: peak/plain", result["ratio"], "< 1 (memory)",
                          result["ratio"] < 1)]
    emit(result)
    return result


if __name__ == "__main__":
    main()
