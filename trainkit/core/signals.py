"""Preemption: turn SIGTERM, SIGINT, SIGHUP and SIGUSR1 into a flag the loop checks.

A signal does not interrupt the step in flight: the loop finishes it, saves one checkpoint and
stops with status ``preempted``. A second signal aborts at once (a second Ctrl-C raises
``KeyboardInterrupt``), for when the save itself is not wanted -- except, under a launcher that
forwards signals (torchrun, srun), the same signal again within :data:`REPEAT_WINDOW_S`: that is
one request delivered twice, the group's copy and the launcher's. Elsewhere (a terminal, a
Jupyter kernel's stop button) no copy is forwarded, so a second press always aborts.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
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
# Under torchrun or srun, the same signal again within this many seconds is the same request,
# not a second one: a signal to a job's process group reaches each worker directly and, forwarded,
# from the launcher.
REPEAT_WINDOW_S = 2.0
# Set in the processes that torchrun (TorchElastic) and srun start: they forward signals.
_FORWARDING_LAUNCHERS = ("TORCHELASTIC_RUN_ID", "SLURM_STEP_ID")


def _repeat_window_s() -> float:
    forwarded = any(name in os.environ for name in _FORWARDING_LAUNCHERS)
    return REPEAT_WINDOW_S if forwarded else 0.0


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
        self._received_at = 0.0
        self._repeat_window_s = 0.0
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
        self._repeat_window_s = _repeat_window_s()
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
            if (signum == self.received
                    and time.monotonic() - self._received_at < self._repeat_window_s):
                return  # one request that came twice (the group's and the launcher's copy)
            log.warning("second signal (%s): aborting without saving", name)
            raise KeyboardInterrupt
        self.received, self._received_at = signum, time.monotonic()
        # Rank 0 alone says it: a signal to the whole job reaches every rank at once, and all of
        # them stop at the same step anyway (other ranks' consoles show warnings only).
        say = log.warning if os.environ.get("RANK", "0") == "0" else log.info
        say("received %s: finishing this step, saving a checkpoint, then stopping "
            "(send it again to abort without saving)", name)


class StoppedOutsideTraining(BaseException):
    """A preemption signal came outside the training steps (before the first, as the run starts
    up, or after the last): there is no step to finish and save.

    A ``BaseException``, like ``KeyboardInterrupt``, so that no ``except Exception`` on the way
    (Hydra's, a dataset's) swallows it. Entry points print :attr:`message` and exit 75.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def message(self) -> str:
        return (f"stopped by {signal.Signals(self.signum).name} outside the training steps "
                "(before the first or after the last); re-run the same command to start or "
                "resume the run")


def stop_outside_training() -> dict[int, Any]:
    """For entry points, as early as they can: whenever no :class:`Preemption` is active (it is
    during ``Trainer.fit``'s steps), a preemption signal raises :class:`StoppedOutsideTraining`
    in the main thread, instead of killing the process by its default action (SIGHUP: 129).

    Signals ignored (``nohup``) stay ignored. Once raised, the previous handlers come back, so a
    second signal acts at once; the same signal again is ignored (torchrun forwards its copy).
    Returns the handlers it replaced (:func:`trainkit.preemptible` puts them back).
    """
    previous = {signum: signal.getsignal(signum) for signum in PREEMPTION_SIGNALS}

    def stop(signum: int, frame: FrameType | None) -> None:
        for other, handler in previous.items():
            signal.signal(other, signal.SIG_IGN if other == signum else handler)
        raise StoppedOutsideTraining(signum)

    for signum, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(signum, stop)
    return previous


def shield_worker(worker_id: int | None = None) -> None:
    """In a DataLoader worker: outlive preemption signals sent to the whole process group.

    Ctrl-C, ``kill -- -PGID`` and schedulers signal the workers too; one that dies of it fails the
    main process before it can save. So the worker ignores SIGINT, SIGHUP and SIGUSR1, and SIGTERM
    unless its parent sends it (as torch's own handler does); the main process handles the signal.
    Use it as a ``worker_init_fn`` or through :func:`shielded_worker_init` (``make_loader`` does).
    """
    can_check_sender = hasattr(signal, "sigwaitinfo")  # not on macOS: there SIGTERM is ignored
    for signum in PREEMPTION_SIGNALS:
        if signum != signal.SIGTERM or not can_check_sender:
            signal.signal(signum, signal.SIG_IGN)
    if not can_check_sender:
        return
    # A blocked SIGTERM stays pending until the thread below takes it and reads its sender (an
    # ignored one would be discarded unseen). Threads started later in the worker inherit the
    # mask, so none of them acts on it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_exit_on_parents_sigterm, args=(os.getppid(),), daemon=True,
                     name="trainkit-sigterm").start()


def _exit_on_parents_sigterm(parent: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(0)  # as torch's worker handler does, so the parent reports no failure


def shielded_worker_init(
        worker_init_fn: Callable[[int], None] | None = None) -> Callable[[int], None]:
    """A ``worker_init_fn`` that runs :func:`shield_worker`, then ``worker_init_fn`` if given
    (picklable when yours is, for the ``spawn`` start method).

    Example:
        >>> DataLoader(data, num_workers=4,  # doctest: +SKIP
        ...            worker_init_fn=shielded_worker_init(my_init))
    """
    return functools.partial(_shield_then, worker_init_fn)


def _shield_then(worker_init_fn: Callable[[int], None] | None, worker_id: int) -> None:
    shield_worker(worker_id)
    if worker_init_fn is not None:
        worker_init_fn(worker_id)
