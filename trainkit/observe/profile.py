"""``trainer.profile``: torch.profiler traces of a few steps, the top operators in train.log, and
CUDA memory snapshots (at the end of each profiled window and at an out-of-memory error).

Off by default, and then nothing of it runs: the :class:`Profiler` is a callback the Trainer adds
only when ``trainer.profile.enabled`` (its ``on_step_end`` is the per-step cost, and only then).
Traces go to ``<run>/profile/rank<R>/trace_step<N>.json`` (Chrome's ``chrome://tracing`` or
https://ui.perfetto.dev read them), memory snapshots to ``<run>/profile/rank<R>/memory_step<N>
.pickle`` and ``<run>/profile/oom_rank<R>.pickle`` (https://pytorch.org/memory_viz reads them).
docs/gpu-idle.md shows how to read both.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile, schedule

from trainkit.config import ProfileConfig

log = logging.getLogger("trainkit")
# allocations remembered for a snapshot: the allocator's recent history, enough for a few steps
_MAX_ENTRIES = 100_000


class MemoryHistory:
    """The CUDA allocator's record of allocations, with their Python stacks, and its snapshots.

    ``torch.cuda.memory._record_memory_history`` and ``_dump_snapshot`` are underscored but are
    the API PyTorch documents ("Understanding CUDA Memory Usage"). Python stacks only: C++ ones
    slow every allocation. ``record`` and ``dump`` default to those two (tests pass their own).
    """

    def __init__(self, record: Callable[..., None] | None = None,
                 dump: Callable[[str], None] | None = None) -> None:
        self._record = record or torch.cuda.memory._record_memory_history
        self._dump = dump or torch.cuda.memory._dump_snapshot
        self.recording = False

    def start(self) -> None:
        if not self.recording:
            self._record(enabled="all", context="all", stacks="python", max_entries=_MAX_ENTRIES)
            self.recording = True

    def stop(self) -> None:
        if self.recording:
            self._record(enabled=None)
            self.recording = False

    def dump(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._dump(str(path))


class Profiler:
    """Profiles the steps of one rank on ``config``'s schedule; a Trainer callback.

    With ``config.memory_snapshot`` (CUDA), allocations are recorded during each window's
    active steps only, and snapshots written at each window's end and at an out-of-memory
    error (outside a window that one has the allocator's blocks, without their stacks).

    Args:
        config: the schedule (wait, warmup, active, repeat), the ranks, the snapshots.
        run_dir: the run's folder; traces go to ``<run_dir>/profile/rank<R>/``.
        rank: this process's rank.
        device: the training device (CUDA adds its kernels and the memory snapshots).
        memory: the allocations' record; default: CUDA's when ``config.memory_snapshot`` asks
            for it on a CUDA device, else none.
    """

    def __init__(self, config: ProfileConfig, run_dir: Path, rank: int,
                 device: torch.device, memory: MemoryHistory | None = None) -> None:
        self.config, self.rank, self.device = config, rank, device
        self.folder = run_dir / "profile" / f"rank{rank}"
        self.oom_file = run_dir / "profile" / f"oom_rank{rank}.pickle"
        self._profile: profile | None = None
        self._schedule = schedule(wait=config.wait, warmup=config.warmup, active=config.active,
                                  repeat=config.repeat)
        if memory is None and config.memory_snapshot and device.type == "cuda":
            memory = MemoryHistory()
        self._memory = memory

    def on_fit_start(self, trainer: Any) -> None:
        cfg = self.config
        self.folder.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(activities=activities, on_trace_ready=self._trace_ready,
                                schedule=self._schedule)
        self._profile.start()
        self._follow_windows()
        log.info("profiling steps on rank %d: wait %d, warmup %d, active %d, repeat %d; traces "
                 "in %s", self.rank, cfg.wait, cfg.warmup, cfg.active, cfg.repeat, self.folder)

    def on_step_end(self, trainer: Any, step: int) -> None:
        if self._profile is not None:
            self._profile.step()  # at a window's end: _trace_ready, its snapshot
            self._follow_windows()

    def on_fit_end(self, trainer: Any, summary: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop profiling (a window cut short writes what it has); stop recording allocations."""
        if self._profile is not None:
            prof, self._profile = self._profile, None
            prof.stop()
        if self._memory is not None:
            self._memory.stop()

    def out_of_memory(self, error: BaseException) -> None:
        """At a CUDA out-of-memory error (before anything is released): the snapshot, if on."""
        if self._memory is None:
            return
        self._memory.dump(self.oom_file)
        log.info("memory snapshot at the out-of-memory error: %s (open it in "
                 "https://pytorch.org/memory_viz)", self.oom_file)

    def _follow_windows(self) -> None:
        """Allocations recorded during the next step when it is an active one, else not."""
        if self._memory is None or self._profile is None:
            return
        action = self._schedule(self._profile.step_num)  # the next step's, as the profiler's
        if action in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE):
            self._memory.start()
        else:
            self._memory.stop()

    def _trace_ready(self, prof: profile) -> None:
        """The end of an active window: its trace, its top operators, its memory snapshot."""
        step = prof.step_num
        path = self.folder / f"trace_step{step}.json"
        prof.export_chrome_trace(str(path))
        for line in top_operators(prof, self.config.top_ops, self.device):
            log.info("profile rank %d to step %d: %s", self.rank, step, line)
        if self._memory is not None:
            self._memory.dump(self.folder / f"memory_step{step}.pickle")
        log.info("profile trace: %s (open in https://ui.perfetto.dev)", path)


def top_operators(prof: profile, count: int, device: torch.device) -> list[str]:
    """The ``count`` operators with the most self time (on the GPU, when profiled there), one
    line each: name, self time, share of the window's, calls."""
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    total = sum(getattr(e, attr) for e in events) or 1.0
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    return [f"{e.key} self {getattr(e, attr) / 1000:.2f} ms "
            f"({100 * getattr(e, attr) / total:.0f}%), {e.count} calls"
            for e in events[:count] if getattr(e, attr) > 0]


def profilers(config: ProfileConfig, run_dir: Path | None, rank: int,
              device: torch.device) -> list[Profiler]:
    """``[Profiler]`` when ``config`` profiles this rank of a run with a folder, else ``[]``."""
    if not config.enabled or rank not in config.ranks:
        return []
    if run_dir is None:
        log.warning("trainer.profile is on but the Trainer has no run_dir: nothing to write "
                    "traces to, no profiling")
        return []
    return [Profiler(config, Path(run_dir), rank, device)]
