"""The one thread of a process that looks at the entered hang watchdogs."""

from __future__ import annotations

import os
import threading
import time
from typing import Any


class Looks:
    """The one thread of a process that looks at the entered watchdogs, each at its own interval.

    It starts with the first watchdog entered and then waits while none is, rather than a thread
    per fit (benchmarks/README.md, "Per fit and per log line"). Looks run under the lock, so
    once :meth:`remove` returns no look of that watchdog runs. A watchdog is anything with
    ``poll_s`` (real seconds), ``look_or_stop()`` and ``arm_fallback(remaining)``: a
    :class:`~trainkit.distributed.watchdog.Watchdog`, which dates what a look sees by its clock.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: dict[Any, float] = {}  # entered watchdog -> when its next look is due
        self._thread: threading.Thread | None = None

    def add(self, watchdog: Any) -> None:
        with self._cond:
            self._due[watchdog] = time.monotonic() + watchdog.poll_s
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="trainkit-watchdog",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()  # its interval may be shorter than the current wait

    def remove(self, watchdog: Any) -> None:
        with self._cond:  # waits for a look in progress
            self._due.pop(watchdog, None)
            watchdog.arm_fallback(None)

    def look(self, watchdog: Any) -> None:
        """One look at an entered ``watchdog`` now, as this thread's next one would be (under
        the lock: never at the same time as the thread's own)."""
        with self._cond:
            if watchdog in self._due:
                self._look(watchdog)

    def _look(self, watchdog: Any) -> None:
        if watchdog.look_or_stop():
            self._due[watchdog] = time.monotonic() + watchdog.poll_s
        else:
            del self._due[watchdog]

    def _run(self) -> None:
        with self._cond:
            while True:
                wake = self._look_due()
                self._cond.wait(None if wake is None else max(wake - time.monotonic(), 0.0))

    def _look_due(self) -> float | None:
        """Look at the watchdogs that are due; when the next look is due (None: none entered).

        A function of its own so that no watchdog stays in the waiting thread's locals: the
        last one looked at would keep its Trainer (model, optimizer, data workers) alive.
        """
        for watchdog, due in list(self._due.items()):
            if due <= time.monotonic():
                self._look(watchdog)
        return min(self._due.values(), default=None)


LOOKS = Looks()
if hasattr(os, "register_at_fork"):  # a forked child has no watching thread, nor its lock held
    os.register_at_fork(after_in_child=LOOKS.__init__)
