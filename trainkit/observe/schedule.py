"""When the loop logs: every ``log_every_n_steps`` steps, and when ``log_every_n_seconds`` passed
since the last logging step (slow steps still report). The one logging policy: the loop asks it
once per step, before the step, and that answer decides both the log and the host's read."""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class LogSchedule:
    """Decides which steps log, by step count and by time.

    Args:
        every_n_steps: log at every multiple of this step count.
        every_n_seconds: also log when this long passed since the last logging step was
            decided (0: never by time).
        clock: seconds on a monotonic clock (``time.perf_counter``; tests pass their own).

    Example:
        >>> schedule = LogSchedule(every_n_steps=50, every_n_seconds=0)
        >>> schedule.should_log(50), schedule.should_log(51)
        (True, False)
    """

    def __init__(self, every_n_steps: int, every_n_seconds: float = 0.0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.every_n_steps, self.every_n_seconds = every_n_steps, every_n_seconds
        self._clock = clock
        self._deadline = math.inf
        self.logged()

    def should_log(self, step: int) -> bool:
        """Whether step ``step`` logs, asked once, before the step runs (one modulo, one clock
        read): the step then reads its checks on the host, as its log waits for the device
        anyway. A step that logs starts the next time period; a step longer than the period
        thus logs every time."""
        if step % self.every_n_steps and self._clock() < self._deadline:
            return False
        self.logged()
        return True

    def due_by_time(self) -> bool:
        """Whether ``every_n_seconds`` passed since the last logging step; when so, the next
        period starts now (the caller logs a step for it: under several ranks, rank 0's
        answer, agreed in the ranks' vote)."""
        if self._clock() < self._deadline:
            return False
        self.logged()
        return True

    def logged(self) -> None:
        """Start the time period from now: the next time-based log is ``every_n_seconds`` away."""
        seconds = self.every_n_seconds
        self._deadline = self._clock() + seconds if seconds else math.inf
