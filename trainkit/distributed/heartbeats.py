"""Every rank's heartbeat, side by side: the store that holds them, who is behind, one line.

A heartbeat record is a small dict a rank's watchdog thread publishes every few seconds:
``step`` (last completed, None before the first), ``idle_s`` (seconds since), ``busy`` (an
evaluation or checkpoint in progress, else None), ``hung``, ``where`` (the innermost frame of
the training thread, once hung) and ``seq`` (collectives issued, None where unknown).
"""

from __future__ import annotations

import json
from typing import Any

Record = dict[str, Any]
Records = dict[int, Record | None]  # by rank; None: no heartbeat yet


def behind_ranks(records: Records) -> list[int]:
    """The ranks the others wait for: the fewest steps completed, then the fewest collectives
    issued (a rank waiting inside a collective has issued it; the one it waits for has not)."""
    def progress(rec: Record | None) -> tuple[int, int]:
        if rec is None:
            return (-2, 0)  # no heartbeat at all: stuck before its first look
        step = -1 if rec["step"] is None else rec["step"]
        return (step, rec["seq"] if rec["seq"] is not None else 0)

    lowest = min(progress(rec) for rec in records.values())
    return [rank for rank, rec in sorted(records.items()) if progress(rec) == lowest]


def hang_line(records: Records, stacks: str) -> str:
    """One line: how long, who is behind (step, doing what, where), who waits, where stacks are."""
    behind, where = behind_ranks(records), f"every thread's stack in {stacks}"
    idle = max((rec["idle_s"] for rec in records.values() if rec), default=0.0)
    if len(behind) <= 3:
        who = ", ".join(rank_text(rank, records[rank]) for rank in behind)
    else:
        who = f"ranks {_ranges(behind)}"
    if len(records) == 1:
        return f"hang: no progress for {seconds_text(idle)}: {who}; {where}"
    line = f"hang: no progress for {seconds_text(idle)}; behind: {who}"
    waiting: dict[Any, list[int]] = {}
    for rank, rec in sorted(records.items()):
        if rank not in behind and rec is not None:
            waiting.setdefault(rec["step"], []).append(rank)
    if waiting:
        line += f"; waiting for {'it' if len(behind) == 1 else 'them'}: " + ", ".join(
            f"rank{'s' if len(ranks) > 1 else ''} {_ranges(ranks)} (step {step})"
            for step, ranks in waiting.items())
    return f"{line}; {where}"


def rank_text(rank: int, rec: Record | None) -> str:
    """``rank 1 (last completed step 2, in checkpoint, at forward (net.py:9))``."""
    if rec is None:
        return f"rank {rank} (no heartbeat)"
    parts = [f"last completed step {rec['step']}" if rec["step"] is not None
             else "no step completed yet"]
    if rec["busy"]:
        parts.append(f"in {rec['busy']}")
    if rec["where"]:
        parts.append(f"at {rec['where']}")
    return f"rank {rank} ({', '.join(parts)})"


def seconds_text(value: float) -> str:
    """``2.4 s`` or ``312 s``."""
    return f"{value:.1f} s" if value < 10 else f"{value:.0f} s"


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5``."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


class Board:
    """Every rank's latest heartbeat record, in the job's store (one key per rank)."""

    def __init__(self, store: Any, world_size: int) -> None:
        self.store = store
        self.keys = [f"rank{rank}" for rank in range(world_size)]

    def publish(self, rank: int, record: Record) -> None:
        self.store.set(self.keys[rank], json.dumps(record))

    def read(self) -> Records:
        if self.store.check(self.keys):  # the usual case: one round trip for all ranks
            values = self.store.multi_get(self.keys)
        else:  # a rank not watching yet: get() would block until it is
            values = [self.store.get(key) if self.store.check([key]) else None
                      for key in self.keys]
        return {rank: json.loads(value) if value is not None else None
                for rank, value in enumerate(values)}
