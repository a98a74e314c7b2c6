"""Hang watchdog: when no training step completes for too long, say which rank is stuck and where.

A stuck rank (a worker deadlock, a full disk, a collective one rank never reaches) freezes a DDP
job without a word. The watchdog reads the loop's step counter from a thread of its own (nothing
per step) and, when no step completed for the limit, writes every thread's stack to
``<run_dir>/hangs/rank<R>.txt`` and has rank 0 log which ranks are behind; with
``action="abort"`` rank 0 writes ``summary.json`` (``"status": "hung"``) and every stuck process
exits with :data:`EXIT_HUNG`, so ``torchrun --max-restarts`` resumes from the last checkpoint.
Under torchrun each rank's heartbeat goes through the job's store from that thread only.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from trainkit.core.errors import one_line
from trainkit.distributed import group
from trainkit.distributed.heartbeats import (
    Board,
    Record,
    Records,
    behind_ranks,
    hang_line,
    rank_text,
    seconds_text,
)
from trainkit.distributed.looks import LOOKS
from trainkit.distributed.stacks import dump_stacks, stacks_place, where

log = logging.getLogger("trainkit")

# The exit status of a process the watchdog ended (hang_action=abort): what timeout(1) returns
# when its command timed out. torchrun restarts the group on it like on any failure.
EXIT_HUNG = 124
AUTO_FLOOR_S = 300.0  # the automatic limit never goes below 5 minutes...
AUTO_FACTOR = 10.0  # ...and is 10 times the slowest step (or evaluation, or save) seen
FIRST_STEP_S = 900.0  # the first step of a fit may compile, autotune and start loader workers
BUSY_FLOOR_S = 1800.0  # an evaluation or checkpoint save may take this long in any case
MAX_POLL_S = 5.0
_T = TypeVar("_T", bound=Callable[..., Any])


class Watchdog:
    """Reports (or ends) a process whose training steps stopped completing.

    Args:
        timeout_s: seconds without a completed step that count as a hang; None derives it from
            the steps seen (10 x the slowest, at least 5 minutes); 0 turns the watchdog off.
            Evaluations and checkpoint saves (:meth:`busy`) get at least 30 minutes and 10 x
            the slowest of their kind; the first step of a fit at least 15 minutes.
        action: ``report`` (dump and keep watching) or ``abort`` (dump, then exit with
            :data:`EXIT_HUNG`).
        run_dir: where ``hangs/rank<R>.txt`` goes; None dumps to stderr.
        rank: this process's rank.
        world_size: the number of ranks.
        clock: what dates steps, pauses and hangs, in seconds (``time.monotonic``; a test
            passes one it advances by hand and calls :meth:`look`).

    Example:
        >>> watchdog = Watchdog(timeout_s=600, run_dir="runs/demo")  # doctest: +SKIP
        >>> with watchdog:
        ...     for step, batch in enumerate(data, 1):
        ...         train_step(batch)
        ...         watchdog.beat(step)
    """

    def __init__(self, timeout_s: float | None = None, action: str = "report", *,
                 run_dir: str | Path | None = None, rank: int = 0, world_size: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s, self.action, self.clock = timeout_s, action, clock
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.rank, self.world_size = rank, world_size
        # Called (from the watchdog thread) with the hang's facts before an abort: the Trainer
        # writes summary.json through it.
        self.on_abort: Callable[[dict[str, Any]], None] | None = None
        self._slowest: dict[str, float] = {}  # kind -> longest one seen, seconds
        self.poll_s = MAX_POLL_S if not timeout_s else min(MAX_POLL_S, max(0.1, timeout_s / 4))
        self._entered = False
        self._progress: Callable[[], int] | None = None  # follow()'s counter
        self._reset()

    def beat(self, step: int) -> None:
        """Record that ``step`` just completed: one attribute store, nothing else (no clock: the
        watching thread dates the step by the look that first sees it, at most a poll late)."""
        self._step = step

    def follow(self, progress: Callable[[], int]) -> None:
        """Take the last completed step from ``progress()`` instead of :meth:`beat`.

        The watching thread calls it at each look, so a loop that counts its steps anyway spends
        nothing per step on the watchdog. The count as the watching starts means that no step
        has completed yet (a resumed run's counter starts where it left off).
        """
        self._progress = progress

    @contextlib.contextmanager
    def busy(self, kind: str) -> Iterator[None]:
        """Mark an evaluation or a checkpoint save: it gets its own, longer limit."""
        started = self.clock()
        self._busy = (*self._busy, (kind, started))
        try:
            yield
        finally:
            now = self.clock()
            self._slowest[kind] = max(self._slowest.get(kind, 0.0), now - started)
            if len(self._busy) == 1:  # the step clock restarts after the pause...
                self._since = now
            self._busy = self._busy[:-1]  # ...before the pause ends: the thread reads _busy first

    def limit(self, kind: str = "step") -> float:
        """Seconds without progress that count as a hang while doing ``kind``.

        ``kind`` is ``step``, ``first step`` (none completed yet in this fit), or what
        :meth:`busy` was given (``evaluation``, ``checkpoint``).
        """
        step = self.timeout_s if self.timeout_s is not None else max(
            AUTO_FLOOR_S, AUTO_FACTOR * self._slowest.get("step", 0.0))
        if kind == "step":
            return step
        if kind == "first step":
            return max(step, FIRST_STEP_S)
        return max(step, BUSY_FLOOR_S, AUTO_FACTOR * self._slowest.get(kind, 0.0))

    def __enter__(self) -> Watchdog:
        if self.timeout_s == 0:
            return self
        self._reset()
        self._first = self._progress() if self._progress is not None else None
        store = group.attempt_store("hang")
        self._board = Board(store, self.world_size) if store is not None else None
        self._owner = threading.get_ident()  # the thread whose steps are watched
        LOOKS.add(self)
        self._entered = True
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if not self._entered:
            return
        LOOKS.remove(self)  # no look of this watchdog runs from here on
        self._entered = False
        if kind is None and (self._reported or self._hang):  # it ended before the next look
            self._recovered(self._completed())

    def _completed(self) -> int | None:
        """The last step completed in this fit; None while none has."""
        if self._progress is None:
            return self._step
        step = self._progress()
        return None if step == self._first else step

    def _recovered(self, step: int | None) -> None:
        if self.rank == 0:
            log.info("hang over: training moves again (step %s)", step)
        else:
            log.warning("rank %d: hang over, moving again (step %s)", self.rank, step)
        self._hang, self._reported = None, False

    # -- the watchdog thread ------------------------------------------------------------------

    def _reset(self) -> None:
        self._step: int | None = None  # the last completed step (the loop's beat)
        self._first: int | None = None  # follow()'s count as the watching started
        self._since = self.clock()  # the step clock's start: the fit's, or a pause's end
        self._noticed: tuple[int | None, float] = (None, 0.0)  # (step, the look that first saw it)
        self._busy: tuple[tuple[str, float], ...] = ()  # (kind, since), outermost first
        self._hang: dict[str, Any] | None = None  # this process's hang, while it lasts
        self._reported = False  # rank 0: the hang line is out and no recovery line yet
        self._hung_looks = 0  # rank 0: consecutive looks that saw some rank hung
        self._seen: tuple[int | None, float] = (None, 0.0)  # (step, its idle time) at last look
        self._board: Board | None = None
        self._store_failed = False  # warned once that the job's store did not answer
        self._armed = False  # faulthandler's timer is ours and running

    def look(self) -> None:
        """Look now, as the watching thread does every ``poll_s`` (never at the same time as
        it): what a test that advances an injected clock calls. Nothing while not entered."""
        LOOKS.look(self)

    def look_or_stop(self) -> bool:
        """One look (the watching thread's); False when it failed and this watchdog stops
        watching."""
        try:
            self._look(self.clock())
            return True
        except Exception as err:  # never take training down; say that watching stopped
            log.warning("hang watchdog stopped: %s", one_line(err))
            self.arm_fallback(None)  # a timer nobody re-arms would report a false hang
            return False

    def _look(self, now: float) -> None:
        busy = self._busy  # read before _since: busy() sets _since before it clears _busy
        restarted, step = self._since, self._completed()
        if step != self._noticed[0]:  # a step completed since the last look: about now
            self._noticed = (step, now)
        at = max(self._noticed[1], restarted)
        if busy:
            kind, since = busy[0]
            self._seen = (step, 0.0)
        else:
            kind, since = ("step" if step is not None else "first step"), at
            seen_step, seen_idle = self._seen
            if step != seen_step and seen_step is not None:  # a gap ended: it lasted >= that
                self._slowest["step"] = max(self._slowest.get("step", 0.0), seen_idle)
            self._seen = (step, now - at)
        idle, limit = now - since, self.limit(kind)
        started = idle > limit and self._hang is None
        if started:
            self._hang = {"where": where(self._owner)}
        elif idle <= limit and self._hang is not None:
            self._hang = None
            if self.rank != 0:
                self._recovered(step)
        self.arm_fallback(limit - idle)
        record = self._record(step, idle, kind if busy else None)
        if started:
            stacks = dump_stacks(self.run_dir, self.rank, f"{_doing(kind, step)} for "
                                 f"{seconds_text(idle)} (limit {seconds_text(limit)})")
            if self.rank != 0:  # rank 0 speaks for every rank below
                log.warning("hang: no progress for %s on %s; stacks in %s", seconds_text(idle),
                            rank_text(self.rank, record), stacks)
        if self._board is not None:
            self._exchange(self._board.publish, self.rank, record)
        if self.rank == 0:  # its own record alone while the store does not answer
            self._overview(self._records(record) or {self.rank: record})
        if self._hang is not None and self.action == "abort":
            self._abort(record)

    def _record(self, step: int | None, idle: float, busy: str | None) -> Record:
        """This rank's heartbeat as the others see it."""
        hang = self._hang or {}
        return {"step": step, "idle_s": round(idle, 1), "busy": busy, "hung": bool(hang),
                "where": hang.get("where"), "seq": group.collectives_issued()}

    def _records(self, own: Record) -> Records | None:
        """Every rank's record; None when the store did not answer this time."""
        if self._board is None:
            return {self.rank: own}
        return self._exchange(self._board.read)

    def _exchange(self, call: Callable[..., Any], *args: Any) -> Any:
        """A call to the job's store. One that fails (its host restarted, a reset) skips this
        look's exchange instead of ending the watching: this rank's own hang is still seen."""
        try:
            return call(*args)
        except Exception as err:
            if not self._store_failed:
                log.warning("hang watchdog: the job's store did not answer (%s); until it does, "
                            "each rank reports only its own hangs", one_line(err))
                self._store_failed = True
            return None

    def _overview(self, records: Records) -> None:
        """Rank 0: one line when some rank hangs, one when all move again."""
        hung = any(rec and rec["hung"] for rec in records.values())
        self._hung_looks = self._hung_looks + 1 if hung else 0
        # a rank behind says where it is stuck at its own look, which may come after this one:
        # wait for it a few looks, so that the line names the place
        behind = behind_ranks(records) if hung else []
        told = all(records[rank] is None or records[rank]["hung"] for rank in behind)
        if hung and not self._reported and (told or self._hung_looks > 3):
            self._report(records)
        elif not hung and self._reported:
            steps = [rec["step"] for rec in records.values() if rec and rec["step"] is not None]
            self._recovered(min(steps, default=None))

    def _report(self, records: Records) -> None:
        log.warning(hang_line(records, stacks_place(self.run_dir, self.rank, self.world_size)))
        self._reported = True

    def arm_fallback(self, remaining: float | None) -> None:
        """A C timer that dumps to stderr should this thread itself never run again (a C call
        that holds the GIL): re-armed at every look, so it fires only if the looks stop.

        Once this thread saw a hang: with ``action="abort"`` the timer ends the process (status
        1) after the abort's grace, should the abort's own file writes or waits block (the run
        dir on the very disk that hangs); with ``report`` it is disarmed, as by ``None``.
        """
        if remaining is not None and sys.__stderr__ is not None and (
                self._hang is None or self.action == "abort"):
            if self._hang is None:
                faulthandler.dump_traceback_later(max(remaining, 0.0) + 3 * self.poll_s + 5,
                                                  file=sys.__stderr__)
            else:
                faulthandler.dump_traceback_later(2 * self._abort_grace_s + 30, exit=True,
                                                  file=sys.__stderr__)
            self._armed = True
        elif self._armed:  # only our own timer: another one (pytest's) is left alone
            faulthandler.cancel_dump_traceback_later()
            self._armed = False

    @property
    def _abort_grace_s(self) -> float:
        """How long an abort waits for the other ranks' stacks (rank 0) or for rank 0 (twice)."""
        return 3 * self.poll_s + 10

    def _abort(self, own: Record) -> None:
        """Write the summary (rank 0), then exit so that torchrun can restart the group."""
        board, grace = self._board, self._abort_grace_s
        if self.rank == 0:
            records = self._records(own) or {self.rank: own}
            deadline = time.monotonic() + grace
            # the others stall at about the same moment: give them time to dump their stacks
            while board is not None and time.monotonic() < deadline and not all(
                    rec and rec["hung"] for rec in records.values()):
                time.sleep(self.poll_s)
                records = self._records(own) or records
            if not self._reported:  # the ranks behind had the grace to say where they are
                self._report(records)
            behind = behind_ranks(records)
            steps = [records[r]["step"] for r in behind if records[r] is not None]
            hang = {"ranks": behind, "step": min(steps, default=None),
                    "idle_s": max(rec["idle_s"] for rec in records.values() if rec),
                    "stacks": stacks_place(self.run_dir, self.rank, self.world_size)}
            if self.on_abort is not None:
                try:
                    self.on_abort(hang)
                except Exception as err:  # the exit below matters more than the summary
                    log.error("could not write the summary of the hang: %s", one_line(err))
            log.error("hang_action=abort: exiting with status %d; torchrun --max-restarts (or "
                      "re-running the command) resumes from the last checkpoint", EXIT_HUNG)
            if board is not None:
                self._exchange(board.store.set, "aborted", "1")
        elif board is not None:
            with contextlib.suppress(Exception):  # rank 0 says it is done, or the grace ends
                board.store.wait(["aborted"], datetime.timedelta(seconds=2 * grace))
        for handler in log.handlers:
            handler.flush()
        sys.stdout.flush()
        os._exit(EXIT_HUNG)  # the stuck main thread cannot raise; sys.exit here ends a thread


def watched(kind: str) -> Callable[[_T], _T]:
    """Run a method of an object with a ``_watchdog`` as :meth:`Watchdog.busy` ``kind``."""

    def decorate(method: _T) -> _T:
        @functools.wraps(method)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            with self._watchdog.busy(kind):
                return method(self, *args, **kwargs)

        return run  # type: ignore[return-value]

    return decorate


def _doing(kind: str, step: int | None) -> str:
    if kind in ("step", "first step"):
        return f"no step after step {step}" if step is not None else "no first step"
    return f"in {kind} after step {step}"
