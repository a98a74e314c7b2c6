"""A fit's cold start against its steady state: the first step's seconds and the steady step time.

The first step of a fit pays for what later steps reuse: ``torch.compile``'s tracing and code
generation (all of it, for the whole model or for each repeated block's class), cuDNN's
autotuning, the allocator's first requests. ``summary.json`` carries ``first_step_s`` and
``steady_step_s`` for every run; with ``trainer.compile`` on, a log line at the end says both,
so ``trainer.compile=true`` and ``=regional`` can be compared run against run.
"""

from __future__ import annotations

import logging
import statistics
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

log = logging.getLogger("trainkit")


class StepTimes:
    """The first step's seconds and the steady step time (median of the log windows after it).

    Args:
        device: the run's device (a CUDA first step is synchronised once, at its end, so that
            its seconds include the kernels it queued).
        compile_mode: ``trainer.compile`` (false, true, ``"regional"``), named in the log line.
    """

    def __init__(self, device: torch.device, compile_mode: bool | str = False) -> None:
        self.device, self.compile_mode = device, compile_mode
        self.first_step_s: float | None = None
        self._windows: list[float] = []  # seconds per step of each log window
        self._last_step = 0  # the step the last log window ended at
        self._holds_first = True  # the next log window holds the first step

    def time_first(self, run: Any, done_steps: int,
                   not_training: Callable[[], float] = lambda: 0.0) -> None:
        """Time the next call of ``run.step`` (the fit's first: ``done_steps`` were done before
        it, by a run it resumes), then hand ``run.step`` back: no cost after it.
        ``not_training``: seconds spent so far on what is not training (the one-off FLOP
        count, which runs inside that call), left out of the first step's."""
        inner, holder = run.step, weakref.ref(run)
        self._last_step = done_steps

        def first(*args: Any, **kwargs: Any) -> Any:
            started, aside = time.perf_counter(), not_training()
            result = inner(*args, **kwargs)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # host sync: once per fit
            self.first_step_s = time.perf_counter() - started - (not_training() - aside)
            owner = holder()
            # marked, not compared with `first`: a closure naming itself is a reference cycle
            # that would keep the step (and the model) alive until the cyclic collector runs
            if owner is not None and getattr(owner.step, "times_first_step", False):
                owner.step = inner
            return result

        first.times_first_step = True  # type: ignore[attr-defined]
        run.step = first

    def window(self, scalars: Mapping[str, float], step: int) -> None:
        """A log window ending at ``step``: its time per step, less the first step's own
        seconds when the window holds it."""
        holds_first, self._holds_first = self._holds_first, False
        steps, self._last_step = step - self._last_step, step
        if steps < 1:  # a spike's rollback went back to an earlier step: no count to trust
            return
        seconds = scalars["time/step_ms"] / 1000 * steps
        if not (holds_first and self.first_step_s is not None):
            self._windows.append(seconds / steps)
        elif steps > 1:  # the rest of the window that holds the first step
            self._windows.append(max(seconds - self.first_step_s, 0.0) / (steps - 1))

    @property
    def steady_step_s(self) -> float | None:
        """Median seconds per step over the log windows, the first step left out; None when no
        step but the first was logged."""
        return statistics.median(self._windows) if self._windows else None

    def summary(self) -> dict[str, float | None]:
        """``summary.json``'s ``first_step_s`` and ``steady_step_s``; with compile on, logged."""
        if self.compile_mode and self.first_step_s is not None:
            steady = self.steady_step_s
            log.info("compile=%s: first step %.1f s (cold start: compiling), steady steps %s",
                     "true" if self.compile_mode is True else self.compile_mode,
                     self.first_step_s, "not logged" if steady is None
                     else f"{1000 * steady:.1f} ms")
        return {"first_step_s": self.first_step_s, "steady_step_s": self.steady_step_s}
