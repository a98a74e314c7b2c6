"""NaN/inf losses counted on the device between the host's reads, so steps need no sync.

Reading a loss on the host (``loss.item()``) makes the CPU wait for the GPU to finish the step,
so it cannot queue the next one meanwhile; on short steps that wait is a large share of the time.
The trainer therefore reads the finite-check only at steps where it waits anyway (logging and
checkpoint steps, the last step) and, in between, lets :func:`~trainkit.loop.step.train_window` drop
a bad window's gradients on the device and this counter tally the bad windows there. On the CPU
there is nothing to wait for: every step reads its check, and a bad step is skipped exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from trainkit.core.errors import TrainkitError

log = logging.getLogger("trainkit")

# Device types whose tensors the host reads without waiting for queued work (the CPU runs each op
# before the next is issued): there every step checks on the host, which skips a bad step
# exactly and costs less than the device-side ops. (The tests empty it to run the GPU's path.)
HOST_READS_FREE = frozenset({"cpu"})


class NonFiniteTally(NamedTuple):
    """What the device counted since the previous read."""

    count: int  # windows whose loss was NaN/inf
    streak: int  # of them, how many in a row at the end (0: the last window was finite)
    longest: int  # the longest run in a row


class NonFiniteCounter:
    """Counts windows whose loss was not finite, on the device; :meth:`read` syncs once.

    Example:
        >>> counter = NonFiniteCounter()
        >>> for loss in (torch.tensor(1.0), torch.tensor(float("nan")), torch.tensor(2.0)):
        ...     counter.add(torch.isfinite(loss))
        >>> counter.read()
        NonFiniteTally(count=1, streak=0, longest=1)
    """

    def __init__(self) -> None:
        self._counts: torch.Tensor | None = None  # [count, streak, longest]; None: nothing added

    def add(self, finite: torch.Tensor) -> None:
        """One window's flag (a 0-d bool tensor, unread): a few tiny device ops, no host read."""
        bad = finite.logical_not().int()
        if self._counts is None:
            self._counts = bad.repeat(3)
            return
        count, streak, longest = self._counts.unbind()
        streak = (streak + 1) * bad  # grows on a bad window, back to 0 on a good one
        self._counts = torch.stack([count + bad, streak, torch.maximum(longest, streak)])

    @property
    def pending(self) -> bool:
        """Whether windows were added since the last read."""
        return self._counts is not None

    def read(self) -> NonFiniteTally:
        """The tally since the last read, then start over (a host sync when anything was added)."""
        if self._counts is None:
            return NonFiniteTally(0, 0, 0)
        tally = NonFiniteTally(*self._counts.tolist())  # host sync
        self._counts = None
        return tally


class NonFiniteLossError(TrainkitError):
    """The loss was NaN or inf for ``trainer.nonfinite_patience`` steps in a row."""


class NonFiniteGuard:
    """Counts NaN/inf losses into the run's state and stops it after ``patience`` in a row.

    Steps checked on the host report their loss in their result; steps checked on the device
    add their unread flag to a :class:`NonFiniteCounter`, read where the loop waits anyway.

    Args:
        patience: bad steps in a row that stop the run; 0 turns the check off.
        state: the loop's counters (``skipped_steps``, ``nonfinite_steps``, ``nonfinite_streak``).
        saved: what the last checkpoint is, in words, for the error that stops the run.
        device: where the loss is; on a :data:`HOST_READS_FREE` device every step reads.
        skips: steps skipped on the device since the last call (a fused optimizer's fp16
            overflows, :meth:`~trainkit.loop.precision.Precision.read_skips`), counted into
            ``skipped_steps`` at each :meth:`read`.
    """

    def __init__(self, patience: int, state: Any, saved: Callable[[], str],
                 device: torch.device | str = "cpu",
                 skips: Callable[[], int] | None = None) -> None:
        self.patience, self.state, self._saved = patience, state, saved
        # steps skipped on the device for another cause (fused fp16 overflows), read with ours
        self._skips = skips
        self._always = torch.device(device).type in HOST_READS_FREE
        # every step reads its check on the host (the CPU): on_host needs no call
        self.host_every_step = patience > 0 and self._always
        self.counter = NonFiniteCounter()
        self._update_idle()

    def _update_idle(self) -> None:
        # idle: no streak runs and the device counted nothing unread, so a finite step checked
        # on the host changes nothing and record() returns at once
        self.idle = not self.state.nonfinite_streak and not self.counter.pending

    def on_host(self, wait_anyway: bool) -> bool:
        """Whether the next step reads its check on the host (and skips a bad step).

        Where the loop waits for the device anyway (``wait_anyway``: a logging step, a
        checkpoint, the last step), at every step while a streak runs, so that the patience
        counts exactly, and at every step where reading costs nothing (the CPU). Other steps
        are checked on the device.
        """
        return self.patience > 0 and (wait_anyway or self._always
                                      or bool(self.state.nonfinite_streak))

    def record(self, result: Any, read_first: bool) -> None:
        """Count a step's result, after the loop counted the step itself.

        With ``read_first``, first read what the device counted for the steps before it (this
        one may extend a streak of them). Then this step's device flag is added, or its host
        verdict counted. Raises :class:`NonFiniteLossError` when a streak reached the patience.
        """
        if result.finite and result.finite_flag is None and self.idle:
            return  # a finite step, read on the host (or not checked), with nothing to add up
        # nothing counted on the device (always so on the CPU): no read, no tally
        tally = self.read(upto=self.state.global_step - 1) if (
            read_first and self.counter.pending) else None
        if result.finite_flag is not None:
            self.counter.add(result.finite_flag)
        if not result.finite or self.state.nonfinite_streak:  # a finite step ends a streak
            self.count(result.finite, result.value)
        self._update_idle()
        if tally is not None:
            self.stop_if_diverged(tally)

    def count(self, finite: bool, value: float | None) -> None:
        """A host-checked step's verdict into the streak; raises when the patience ran out."""
        state = self.state
        if finite:
            state.nonfinite_streak = 0
            return
        state.nonfinite_steps += 1
        state.nonfinite_streak += 1
        log.warning("step %d: loss is %s; step skipped (%d in a row)", state.global_step,
                    value, state.nonfinite_streak)
        if state.nonfinite_streak >= self.patience:
            raise self.diverged(state.nonfinite_streak)

    def read(self, upto: int | None = None) -> NonFiniteTally:
        """Count the NaN/inf windows the device saw since the last read (up to step ``upto``,
        default the state's), into the state.

        A host read (sync) when steps were checked on the device since the last one. Ranks read
        at the same steps and hold the same (all-reduced) tally, so they stop together.
        """
        tally = self.counter.read()
        if self._skips is not None:
            self.state.skipped_steps += self._skips()
        if tally.count:
            state = self.state
            state.nonfinite_steps += tally.count
            state.skipped_steps += tally.count
            state.nonfinite_streak = tally.streak  # device-checked runs start after a finite one
            log.warning("%d step(s) up to step %d had a NaN/inf loss; their gradients were "
                        "dropped", tally.count, state.global_step if upto is None else upto)
        self._update_idle()
        return tally

    def stop_if_diverged(self, tally: NonFiniteTally | None = None) -> None:
        """Raise when ``tally`` (default: a fresh read) holds a streak as long as the patience."""
        tally = self.read() if tally is None else tally
        if tally.count and tally.longest >= self.patience:
            raise self.diverged(tally.longest)

    def reset(self) -> None:
        """End the streak after a rollback to good weights (what the device counted read
        first: the NaN/inf steps undone still count in ``nonfinite_steps``)."""
        self.read()
        self.state.nonfinite_streak = 0
        self._update_idle()

    def steady(self) -> bool:
        """Whether a checkpoint may be written now: the device's count read (raising when the
        run diverged), and no streak running -- in one the weights did not move, and the last
        good checkpoint should stay the newest."""
        self.stop_if_diverged()
        return not self.state.nonfinite_streak

    def diverged(self, streak: int) -> NonFiniteLossError:
        return NonFiniteLossError(
            f"stopped at step {self.state.global_step}: the loss was NaN/inf for "
            f"{streak} steps in a row: lower optim.lr, set "
            "trainer.gradient_clip_val, use bf16-mixed instead of 16-mixed, or check the data",
            details=[self._saved()])
