"""``with trainkit.preemptible():``: a whole script of several phases stops cleanly on a signal.

Inside ``Trainer.fit``'s steps a preemption signal (SIGTERM, SIGINT, SIGHUP, SIGUSR1) finishes
the step, saves a checkpoint and stops the fit; inside the block, that fit then ends the script
with exit status 75, so that no later phase starts. Everywhere else in the block -- loading data,
building models, a fit's set-up, between two fits -- there is no step to save: the signal ends the
script at once with one line and status 75, as ``python -m trainkit.train`` does. Re-running the
script resumes it: a phase whose fit has its own run dir skips a finished fit and resumes an
unfinished one (docs/research.md, "Scripts of several phases").
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from trainkit.core.errors import print_error
from trainkit.core.signals import EXIT_PREEMPTED, StoppedOutsideTraining, stop_outside_training
from trainkit.observe.logging import log_to_file

_open_blocks = 0  # preemptible() blocks open in the main thread


@contextlib.contextmanager
def preemptible() -> Iterator[None]:
    """Make the block's code stop on a preemption signal with one line and exit status 75.

    Use it around a script's whole body (or as a decorator of its ``main``). Signals ignored
    (``nohup``) stay ignored; the previous handlers come back when the block ends. Outside the
    main thread it does nothing (handlers can only be set there).

    Example:
        >>> with trainkit.preemptible():  # doctest: +SKIP
        ...     data = load_data()               # a SIGTERM here: one line, exit 75
        ...     Trainer(cfg, run_dir="runs/x/pretrain").fit(...)  # here: checkpoint, exit 75
        ...     Trainer(cfg, run_dir="runs/x/probe").fit(...)     # a re-run skips the first
    """
    global _open_blocks
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = stop_outside_training()
    _open_blocks += 1
    stopped = False
    try:
        yield
    except StoppedOutsideTraining as stop:
        # the same signal stays ignored until the exit: torchrun's and srun's forwarded copy
        stopped = True
        rank = f"rank {os.environ['RANK']}: " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
        log_to_file(print_error(stop.message, prefix=f"trainkit: {rank}"))
        raise SystemExit(EXIT_PREEMPTED) from None
    finally:
        _open_blocks -= 1
        if not stopped:
            for signum, handler in previous.items():
                if handler is not signal.SIG_IGN:
                    signal.signal(signum, handler)


def exit_if_preempted(summary: Mapping[str, Any]) -> None:
    """For ``Trainer.fit``: inside a :func:`preemptible` block, a fit stopped by a signal (its
    checkpoint saved, its summary written) ends the script with exit status 75."""
    if _open_blocks and summary.get("status") == "preempted":
        raise SystemExit(EXIT_PREEMPTED)
