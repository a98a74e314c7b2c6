"""Checkpoint save time: trainkit's durable saves vs the durable `torch.save` a careful user writes.

    python -m benchmarks.checkpoint            # a ~100 MB state
    python -m benchmarks.checkpoint --quick    # a ~1 MB state

The state is shaped like a trainer checkpoint: a model's ``state_dict`` (8 square linear layers)
plus an Adam ``state_dict`` after one step (two moment tensors per parameter), a step counter and
RNG state, about ``--size-mb`` in all. Sides, each writing to its own file in the same temporary
folder on the same filesystem, in rounds of A B C D D C B A:

- ``durable``: the baseline, the durable floor: ``torch.save`` to a temporary name, ``flush`` +
  ``os.fsync``, ``os.replace`` onto the final name, ``os.fsync`` of the folder -- what a careful
  user writes so that a crash leaves the old file or the new one, never a torn one.
- ``bare``: ``torch.save(state, path)``: what most scripts do (context: the price of durability).
  Its bytes may still sit in the page cache when it returns.
- ``manager``: ``CheckpointManager.save(periodic=True)``: the durable write of ``last.pt`` plus
  the hard-linked ``step_<n>.pt`` and rotation (keep_last=1): what the trainer does.
- ``async_blocked``: ``AsyncCheckpointWriter.save`` (``checkpoint.async_save=true``): how long
  the training loop is blocked -- copying the state into the memory the previous save used,
  starting the writer thread. The write itself then runs beside training (the side waits for it
  outside the clock).

``os.sync()`` runs before each save, outside the clock, so no side pays to flush another's dirty
pages. Ratios are medians over rounds of summed times. Goal: ``manager / durable <= 1.05``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.common import alternate, emit, median, ratio, row, timed
from trainkit import AsyncCheckpointWriter, CheckpointManager

GOAL = 1.05


def make_state(size_mb: float) -> dict[str, Any]:
    """A checkpoint-like dict of about ``size_mb`` MB: model + Adam moments + counters + RNG."""
    params = size_mb * 1e6 / 4 / 3  # fp32 weights, and Adam keeps two more tensors per weight
    width = max(8, int(math.sqrt(params / 8)))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(8)))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()  # creates exp_avg / exp_avg_sq
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "global_step": 1,
            "rng": {"torch": torch.get_rng_state()}}


def state_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def durable_save(state: dict[str, Any], path: Path) -> None:
    """The durable floor: write a temporary file, fsync it, rename it, fsync the folder."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sides(state: dict[str, Any], folder: Path) -> dict[str, Callable[[], float]]:
    manager = CheckpointManager(folder / "checkpoints", keep_last=1)
    writer = AsyncCheckpointWriter(CheckpointManager(folder / "async", keep_last=1))
    step = itertools.count(1)

    def clean(fn: Callable[[], Any]) -> Callable[[], float]:
        def run() -> float:
            os.sync()  # start from no dirty pages, outside the clock
            return timed(fn)
        return run

    def async_blocked() -> float:
        os.sync()
        blocked = timed(lambda: writer.save(state, next(step), periodic=True))
        writer.wait()  # outside the clock: training would run meanwhile
        return blocked

    return {
        "durable": clean(lambda: durable_save(state, folder / "durable.pt")),
        "bare": clean(lambda: torch.save(state, folder / "bare.pt")),
        "manager": clean(lambda: manager.save(state, next(step), periodic=True)),
        "async_blocked": async_blocked,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=100.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None,
                        help="folder for the files (default: a temporary one in the system's)")
    parser.add_argument("--quick", action="store_true", help="a ~1 MB state, one round")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_mb, args.rounds = 1.0, 1
    state = make_state(args.size_mb)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        run = sides(state, Path(tmp))
        for fn in run.values():  # warm up: first-touch page faults, lazy imports
            fn()
        samples = alternate(run, args.rounds)
    ratios = {
        "manager/durable": ratio(samples, "manager", "durable"),
        "durable/bare": ratio(samples, "durable", "bare"),
        "manager/bare": ratio(samples, "manager", "bare"),
        "async_blocked/bare": ratio(samples, "async_blocked", "bare"),
    }
    met = ratios["manager/durable"] <= GOAL
    result = {
        "benchmark": "checkpoint",
        "state_mb": state_bytes(state) / 1e6,
        "rounds": args.rounds,
        "median_s": {name: median(samples, name) for name in samples},
        "ratios": ratios,
        "samples": samples,
        "goal": f"manager/durable <= {GOAL}",
        "rows": [
            row("checkpoint: manager.save/durable torch.save", ratios["manager/durable"],
                f"<= {GOAL}", met),
            row("checkpoint: durable torch.save/bare torch.save", ratios["durable/bare"],
                "(durability)", None),
            row("checkpoint: async loop blocked/torch.save", ratios["async_blocked/bare"],
                "(async_save)", None),
        ],
    }
    emit(result)
    return result


if __name__ == "__main__":
    main()
