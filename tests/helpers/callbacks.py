"""Callbacks the tests add to real runs (importable by the processes they start)."""

from __future__ import annotations

import json
import os
import signal
from typing import Any


class SigtermAt:
    """Sends this process SIGTERM as step ``step`` ends: a preemption at a known step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer: Any, step: int) -> None:
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class StopOnRank:
    """``trainer.request_stop`` at ``step``, on rank ``rank`` only."""

    def __init__(self, step: int, rank: int = 1) -> None:
        self.step, self.rank = step, rank

    def on_step_end(self, trainer: Any, step: int) -> None:
        if step == self.step and trainer.runtime.rank == self.rank:
            trainer.request_stop(f"rank {self.rank} asked at step {step}")


class Boom:
    """Raises in ``on_step_end``: a callback with a bug."""

    def on_step_end(self, trainer: Any, step: int) -> None:
        raise ValueError(f"boom at step {step}")


class CountBatches:
    """Counts this rank's training steps; writes ``<folder>/rank<R>.json`` when the fit ends."""

    def __init__(self, folder: str) -> None:
        self.folder, self.steps = folder, 0

    def on_step_end(self, trainer: Any, step: int) -> None:
        self.steps += 1

    def on_fit_end(self, trainer: Any, summary: Any) -> None:
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"rank{trainer.runtime.rank}.json")
        with open(path, "w") as file:
            json.dump({"steps": self.steps}, file)
