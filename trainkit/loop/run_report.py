"""How a fit ends, said in one place: ``summary.json`` and the sinks' last word for every ending
(completed, stopped, preempted, diverged, out of memory, hung), and the answer to a re-run of a
run that already ended."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from trainkit.core.errors import TrainkitError
from trainkit.core.runtime import Runtime
from trainkit.distributed import group
from trainkit.loop import oom
from trainkit.loop.step_times import StepTimes
from trainkit.observe.advice import Advisor
from trainkit.observe.metrics import StepMeter
from trainkit.observe.sinks import Sinks
from trainkit.observe.summary import (
    Begun,
    build_summary,
    read_summary,
    write_hparams,
    write_summary,
)

log = logging.getLogger("trainkit")


class RunReport:
    """One fit's ending: its summary, written once, whichever way the fit ends.

    Args:
        runtime: ranks (rank 0 writes ``summary.json``; its sinks get the summary).
        run_dir: where ``summary.json`` goes; None writes none.
        state: the loop's counters (:class:`~trainkit.loop.train_state.TrainState`).
        advisor: what held the run back, said once each (the summary's ``advice``); None: off.
        profilers: ``trainer.profile``'s (a memory snapshot at an out-of-memory error), closed
            with the report.
    """

    def __init__(self, runtime: Runtime, run_dir: Path | None, state: Any,
                 advisor: Advisor | None = None, profilers: Sequence[Any] = ()) -> None:
        self.runtime, self.run_dir, self.state, self.advisor = runtime, run_dir, state, advisor
        self.profilers = list(profilers)
        self.sinks = Sinks()  # the fit's, once set up; closed however the fit ends
        self.started = time.perf_counter()
        self.begun: Begun | None = None  # where this process's share of the run began
        self.meter: StepMeter | oom.Peaks | None = None
        self.startup_s: float | None = None  # process start to the first step, once known
        self.setup_s: float | None = None  # this fit's call to its first step, once known
        self.times = StepTimes(runtime.device)  # the first step's seconds, the steady step time

    def begin(self, meter: StepMeter, started: float, startup_s: float | None,
              setup_s: float) -> None:
        """Training is set up (``started``: ``perf_counter`` once the model was prepared):
        rates count from there, not over a resumed run's earlier steps. ``startup_s``: None
        where the process start is not the user's wait (a second fit, a notebook)."""
        self.meter, self.startup_s, self.setup_s = meter, startup_s, setup_s
        self.begun = Begun(started, self.state.samples_seen, self.state.global_step)

    def time_first(self, run: Any, compile_mode: bool | str) -> None:
        """Time the fit's first step (``run.step``'s next call); ``trainer.compile``'s mode
        is named in the line that says it as the fit ends."""
        self.times.compile_mode = compile_mode
        flops = getattr(run.meter, "flops", None)  # its one-off count runs inside the first step
        self.times.time_first(run, self.state.global_step,
                              (lambda: flops.counted_s) if flops is not None else lambda: 0.0)

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        """A log window's figures to the sinks (and its step time to :attr:`times`)."""
        self.sinks.log(scalars, step)
        self.times.window(scalars, step)

    def log_now(self, scalars: Mapping[str, Any], step: int) -> None:
        """A callback's scalars as ``train/<name>`` at ``step`` (a tensor read on the host)."""
        self.sinks.log({f"train/{name}": float(value) for name, value in scalars.items()}, step)

    def open_sinks(self, sinks: Sinks, config: Mapping[str, Any]) -> None:
        """The fit's sinks, started with the run's ``config`` (a tracker continues its run)."""
        self.sinks = sinks
        sinks.start(self.run_dir, config)

    def advise(self, scalars: Mapping[str, float], step: int, train_step: Any) -> None:
        """The advisor's new lines about a logging window (once per job: warnings on rank 0)."""
        if self.advisor is not None:
            for line in self.advisor.window(scalars, step, train_step):
                (log.warning if self.runtime.is_main else log.info)(line)

    def already_ended(self, total_steps: int, max_epochs: int) -> dict[str, Any] | None:
        """The summary of the run this one resumed at its end (completed, or stopped by
        request), said in one line; None when there is more to do."""
        state = self.state
        stopped = state.stop_reason is not None  # by request_stop: over, however long planned
        if not state.global_step or (not stopped and state.global_step < total_steps
                                     and state.epoch < max_epochs):
            return None
        summary = read_summary(self.run_dir) if self.runtime.is_main else None
        summary = group.all_gather(summary)[0]  # rank 0's: every rank decides alike
        if stopped:  # the loop trains no further; it writes the summary again if it has none
            log.info("this run stopped at step %d (%s): nothing more to train",
                     state.global_step, state.stop_reason)
        if (not summary or summary.get("status") != ("stopped" if stopped else "completed")
                or summary.get("global_step") != state.global_step):
            return None  # stopped at its last step: evaluate and complete it now
        if not stopped:
            log.info("the run is complete at step %d of %d: nothing to do (raise "
                     "trainer.max_steps or trainer.max_epochs to train on)", state.global_step,
                     total_steps)
        return summary

    def finish(self, status: str, results: dict[str, float], **extra: Any) -> dict[str, Any]:
        """Build the summary, write ``summary.json`` (rank 0) and give it to the sinks."""
        if self.begun is None:  # ended before training began (out of memory while resuming)
            self.begun = Begun(self.started, self.state.samples_seen, self.state.global_step)
        meter = self.meter or oom.Peaks(self.runtime.device)
        counters = {**self.state.state_dict(), "epoch_number": self.state.epoch_number}
        summary = build_summary(status, results, counters, self.begun,
                                world_size=self.runtime.world_size, peak_memory=meter.peaks(),
                                startup_s=self.startup_s, setup_s=self.setup_s,
                                advice=list(self.advisor.lines) if self.advisor else [],
                                **self.times.summary(), **extra)
        if self.run_dir is not None and self.runtime.is_main:
            write_summary(self.run_dir, summary)
        self.sinks.finish(status, summary)  # rank 0's sinks; none elsewhere
        return summary

    def hparams(self, config: Mapping[str, Any], results: Mapping[str, float]) -> None:
        """The run's settings with its final metrics for TensorBoard's HPARAMS tab (rank 0)."""
        if results and self.runtime.is_main:
            write_hparams(self.run_dir, config, results)

    def out_of_memory(self, err: torch.cuda.OutOfMemoryError, optimizer: Any, *, batch: Any,
                      accumulate: int, precision: str) -> TrainkitError:
        """Free what the failed step held, end the run as ``oom`` and return the one-line error
        (the allocator's summary goes to train.log; each profiler dumps its memory snapshot)."""
        for profiler in self.profilers:  # the memory as it ran out
            profiler.out_of_memory(err)
        # the figures first: release() empties the cache, and a meter made now resets the peak
        line, details = oom.report(err, self.runtime.device, step=self.state.global_step,
                                   batch=batch, accumulate=accumulate, precision=precision)
        self.meter = self.meter or oom.Peaks(self.runtime.device)
        oom.release(err, optimizer)
        self.finish("oom", {})
        return TrainkitError(line, details=details)

    def abort_hung(self, hang: Any) -> None:
        """``hang_action=abort``: the summary, to the sinks too, before the process exits."""
        self.finish("hung", {}, hang=hang)
        self.sinks.close()

    def __enter__(self) -> RunReport:
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the sinks (after the summary went to them: a tracker flushes before the exit)
        and the profilers."""
        self.sinks.close()
        for profiler in self.profilers:
            profiler.close()
