"""One rank of tests/dist/test_micro_batch.py's exit test, started by torchrun. It never calls
``group.shutdown()``: the group ``Trainer.fit`` joined must be left at the interpreter's exit.

Fit 1, ``micro_batch_size=auto``: rank 1's forward leaves a layer unused (its gradient None
there, on rank 0 not): the vote's all-reduce must zero-fill it. Fit 2: rank 1's optimizer runs
out of memory in its first step: both ranks must end with the out-of-memory report, neither
retrying. Writes ``<out>/rank<R>.pt``, and ``<out>/exit_rank<R>.txt`` at the very end of the
interpreter's exit: whether the process group was still up then.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def _record_exit(path: Path) -> None:  # registered before trainkit's: it runs after it
    path.write_text(str(dist.is_initialized()))


class Branches(nn.Module):
    """A net, plus a layer only ``use_extra`` forwards use."""

    def __init__(self, use_extra: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.extra = nn.Linear(6, 3)
        self.use_extra = use_extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return out + self.extra(x) if self.use_extra else out


def main(out: Path) -> None:
    from tests.dist.micro_batch_fit import batches
    from tests.unit.loop.test_micro_batch_oom import OutOfMemoryAfterStep
    from trainkit import Trainer, TrainerConfig
    from trainkit.core.errors import TrainkitError

    rank = int(os.environ["RANK"])
    config = TrainerConfig(device="cpu", max_steps=2, micro_batch_size="auto")
    model = Branches(use_extra=rank == 0)
    Trainer(config, run_dir=out / "unused").fit(
        model, torch.optim.SGD(model.parameters(), lr=0.5), batches(rank))
    torch.save({"weights": model.state_dict()}, out / f"rank{rank}.pt")
    model = Branches(use_extra=True)
    optimizer = (OutOfMemoryAfterStep if rank == 1 else torch.optim.AdamW)(
        model.parameters(), lr=0.01, foreach=True)
    try:
        Trainer(config, run_dir=out / "oom").fit(model, optimizer, batches(rank))
        error = None
    except TrainkitError as err:
        error = str(err)
    steps = sorted({float(s["step"]) for s in optimizer.state.values()})
    torch.save({"weights": torch.load(out / f"rank{rank}.pt")["weights"], "error": error,
                "steps": steps}, out / f"rank{rank}.pt")


if __name__ == "__main__":
    atexit.register(_record_exit, Path(sys.argv[1]) / f"exit_rank{os.environ['RANK']}.txt")
    main(Path(sys.argv[1]))
