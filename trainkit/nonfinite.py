"""NaN/inf losses counted on the device between the host's reads, so steps need no sync.

Reading a loss on the host (``loss.item()``) makes the CPU wait for the GPU to finish the step,
so it cannot queue the next one meanwhile; on short steps that wait is a large share of the time.
The trainer therefore reads the finite-check only at steps where it waits anyway (logging and
checkpoint steps, the last step) and, in between, lets :func:`~trainkit.step.train_window` drop
a bad window's gradients on the device and this counter tally the bad windows there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


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
