"""Preemption: turn SIGTERM, SIGINT, SIGHUP and SIGUSR1 into a flag the loop checks.

A signal does not interrupt the step in flight: the loop finishes it, saves one checkpoint and
stops with status ``preempted``. A second signal aborts at once (a second Ctrl-C raises
``KeyboardInterrupt``), for when the save itself is not wanted.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

log = logging.getLogger("trainkit")

# SIGTERM: schedulers and `kill`; SIGINT: Ctrl-C; SIGHUP: the SSH session or terminal closed;
# SIGUSR1: SLURM's `--signal=USR1@<seconds>` warning before the time limit.
PREEMPTION_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1")
    if hasattr(signal, name)
)
# The exit status of a run that stopped on a signal after saving its checkpoint: EX_TEMPFAIL
# from sysexits.h, "try again later" -- re-running the same command resumes it.
EXIT_PREEMPTED = 75


class Preemption:
    """Context manager that records preemption signals instead of dying on them.

    Handlers are installed only in the main thread, never over a signal the user chose to
    ignore (``nohup`` ignores SIGHUP), and the previous handlers come back on exit.

    Example:
        >>> with Preemption() as preemption:  # doctest: +SKIP
        ...     for batch in data:
        ...         step(batch)
        ...         if preemption.requested:
        ...             save_checkpoint()
        ...             break
    """

    def __init__(self, signals: tuple[int, ...] = PREEMPTION_SIGNALS) -> None:
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Ask the loop to stop as if ``signum`` had arrived (for tools and tests)."""
        self.received = signum

    def __enter__(self) -> Preemption:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread
        for signum in self.signals:
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN:
                continue
            self._previous[signum] = previous
            signal.signal(signum, self._handle)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            log.warning("second signal (%s): aborting without saving", name)
            raise KeyboardInterrupt
        self.received = signum
        log.warning("received %s: finishing this step, saving a checkpoint, then stopping "
                    "(send it again to abort without saving)", name)
