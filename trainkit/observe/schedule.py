"""When the loop logs: every ``log_every_n_steps`` steps, and when ``log_every_n_seconds`` passed
since the last log line (slow steps still report)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class LogSchedule:
    """Decides which steps log, by step count and by time.

    Args:
        every_n_steps: log at every multiple of this step count.
        every_n_seconds: also log when this long passed since the last log (0: never by time).
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
        """Whether step ``step`` logs (called every step: one modulo, one clock read)."""
        return step % self.every_n_steps == 0 or self._clock() >= self._deadline

    def logged(self) -> None:
        """A log line was written: the time-based one is due ``every_n_seconds`` from now."""
        seconds = self.every_n_seconds
        self._deadline = self._clock() + seconds if seconds else math.inf
