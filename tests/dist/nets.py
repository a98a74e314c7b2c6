"""Models for the multi-process tests: no batch-norm, and faults injected at a chosen step.

A fault fires inside a real worker at a fixed training forward of a fixed rank (first attempt
only), so the tests need no sleeps and no racing against a run that may already have finished.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from pathlib import Path

import torch
from torch import nn

from trainkit.core.errors import TrainkitError

FAULTS = ("sigterm", "sigkill", "error", "sleep")


class FlatNet(nn.Module):
    """A two-layer perceptron for 28x28 images: no batch-norm, so 2 ranks x batch b train
    exactly like 1 process x batch 2b.

    Args:
        num_classes: outputs.
        fault: ``sigterm`` / ``sigkill`` (the process signals itself) or ``error`` (a
            TrainkitError) at training forward number ``fault_at`` of rank ``fault_rank``, or
            ``sleep`` there for ``sleep_s`` seconds (a stuck step), or, with ``until_hang_in``,
            until a run folder under that folder holds this rank's stacks and a ``train.log``
            with the watchdog's hang line (at most ``sleep_s``): a stall that lasts until the
            watchdog has seen it, however loaded the machine, then recovers.
        startup_signal: a signal name (``SIGHUP``) this process sends to its whole process
            group while the model is built: a signal during start-up, before the first step.
        forward_delay_s: seconds every training forward sleeps: a run slow enough that a
            signal sent once a step is logged lands before the last step, on a loaded machine too.
    """

    def __init__(self, num_classes: int = 10, fault: str | None = None, fault_rank: int = 1,
                 fault_at: int = 0, sleep_s: float = 0.0, startup_signal: str | None = None,
                 forward_delay_s: float = 0.0, until_hang_in: str | None = None) -> None:
        super().__init__()
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}")
        if startup_signal is not None:
            os.killpg(os.getpgrp(), getattr(signal, startup_signal))
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 32), nn.ReLU(),
                                 nn.Linear(32, num_classes))
        self.fault, self.fault_rank, self.fault_at = fault, fault_rank, fault_at
        self.sleep_s, self.forward_delay_s = sleep_s, forward_delay_s
        self.until_hang_in = until_hang_in
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            time.sleep(self.forward_delay_s)
            self._maybe_fail()
        return self.net(x)

    def _maybe_fail(self) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if (self.fault is None or not first_attempt or self.calls != self.fault_at
                or int(os.environ.get("RANK", 0)) != self.fault_rank):
            return
        if self.fault == "sleep" and self.until_hang_in is None:
            time.sleep(self.sleep_s)
            return
        if self.fault == "sleep":  # blocked in a system call: the stack's frame is this one
            select.select([_when_hang_seen(Path(self.until_hang_in))], [], [], self.sleep_s)
            return
        if self.fault == "error":
            raise TrainkitError("injected failure for the test")
        os.kill(os.getpid(), signal.SIGTERM if self.fault == "sigterm" else signal.SIGKILL)


def _when_hang_seen(folder: Path) -> int:
    """A pipe's read end that becomes readable once a run folder under ``folder`` holds this
    rank's stacks (``hangs/rank<R>.txt``) and a ``train.log`` with rank 0's hang line (a thread
    looks every 50 ms: this process's main thread stays blocked)."""
    read, write = os.pipe()
    stacks = f"rank{os.environ.get('RANK', 0)}.txt"

    def seen() -> bool:
        return any((log.parent / "hangs" / stacks).is_file()
                   and "hang: no progress" in log.read_text()
                   for log in folder.rglob("train.log"))

    def look() -> None:
        while not seen():
            time.sleep(0.05)  # paces the check; the caller's own timeout bounds the wait
        os.write(write, b"x")

    threading.Thread(target=look, daemon=True).start()
    return read


def rank_sum() -> float:
    """Sum of ``rank + 1`` over all ranks, through a real all-reduce (for launch tests)."""
    import torch.distributed as dist

    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return value.item()
