"""A training process that stops at a known step and waits there for the test's signal.

A test that signals a run mid-training used to wait for a logged step and then race the run to
its end: on a loaded machine the run could finish first. Here the run itself waits: at the step
it writes ``marker`` (its pid; ``{rank}`` in the name becomes its rank) and blocks until one of
the preemption signals has reached the handler it had, so the test waits on events only.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

from trainkit.core.signals import PREEMPTION_SIGNALS as SIGNALS

LONGEST_S = 240.0  # a test that never signals fails on its own timeout, not by a stuck child


def wait_for_a_signal(marker: str) -> None:
    """Write ``marker``, then block until a signal of :data:`SIGNALS` has been handled.

    Each signal's handler is wrapped (and restored afterwards) to note its arrival before it
    runs the handler it had: a signal sent as soon as the file exists is never missed, as it
    would be between writing the file and a ``signal.pause()``."""
    seen = threading.Event()
    before = {signum: signal.getsignal(signum) for signum in SIGNALS}

    def note(signum: int, frame: FrameType | None) -> None:
        seen.set()
        handler = before[signum]
        if callable(handler):
            handler(signum, frame)
        elif handler == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    for signum, handler in before.items():
        if handler is not signal.SIG_IGN:
            signal.signal(signum, note)
    try:
        path = marker.replace("{rank}", os.environ.get("RANK", "0"))
        with open(path + ".tmp", "w") as file:
            file.write(str(os.getpid()))
        os.replace(path + ".tmp", path)  # whole or absent: the test reads the pid
        deadline = time.monotonic() + LONGEST_S
        while not seen.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)  # paces the look; the signal's handler has run when it sees it
    finally:
        for signum, handler in before.items():
            if handler is not signal.SIG_IGN:
                signal.signal(signum, handler)


class PauseAt:
    """A callback: at the end of step ``step``, :func:`wait_for_a_signal` (``marker``)."""

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker = step, marker

    def on_step_end(self, trainer: Any, step: int) -> None:
        if step == self.step:
            wait_for_a_signal(self.marker)


def main(argv: list[str]) -> None:
    """``python -m tests.helpers.pause MARKER STEP SCRIPT ARGS...``: run ``SCRIPT`` (a program
    that trains with its own loop or Trainer) pausing after its ``STEP``-th optimizer step,
    through torch's global optimizer hook."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    marker, step, script, *args = argv
    steps = 0

    def after_step(optimizer: Any, *_: Any) -> None:
        nonlocal steps
        steps += 1
        if steps == int(step):
            wait_for_a_signal(marker)

    register_optimizer_step_post_hook(after_step)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` would have it
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
