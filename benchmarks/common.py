"""Helpers shared by the benchmarks: alternated timing, ratios, timed processes, machine facts.

This machine is shared and noisy, so no benchmark reports an absolute time alone. Sides timed
with :func:`alternate` run inside the same rounds, in palindromic order (A B C C B A): a load
change that drifts linearly through a round hits every side equally, and the per-round ratio
cancels it; :func:`ratio` is the median of the rounds' ratios, which one disturbed round cannot
move.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

Samples = dict[str, list[list[float]]]  # side -> rounds -> that side's measurements in the round
REPO = Path(__file__).resolve().parent.parent


def alternate(sides: Mapping[str, Callable[[], float]], rounds: int) -> Samples:
    """Run every side twice per round, in the order given then reversed; collect what they return.

    Each callable does one measured run and returns its measurement (seconds, steps/s, ...).
    Garbage left by one side is collected before the next starts, outside any clock, so no side
    pays for another's collection.
    """
    names = list(sides)
    samples: Samples = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            samples[name].append([])
        for name in [*names, *reversed(names)]:
            gc.collect()
            samples[name][-1].append(sides[name]())
    return samples


def ratio(samples: Samples, num: str, den: str) -> float:
    """Median over rounds of ``sum(num's measurements) / sum(den's measurements)``.

    Raises:
        SystemExit: ``den`` measured 0 in a round (nothing to compare against); one line.
    """
    if any(sum(b) == 0 for b in samples[den]):
        raise SystemExit(f"{num}/{den}: {den} measured 0, so there is no ratio; the measurement "
                         "is broken or the sizes are too small to register")
    return statistics.median(sum(a) / sum(b) for a, b in zip(samples[num], samples[den]))


def median(samples: Samples, side: str) -> float:
    """Median of one side's measurements over all rounds (for context next to a ratio)."""
    return statistics.median(x for round_ in samples[side] for x in round_)


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn`` takes, on the monotonic high-resolution clock."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def row(name: str, value: float | None, goal: str, met: bool | None,
        unit: str = "x") -> dict[str, Any]:
    """One line of the summary table; ``value`` and ``met`` are None where a side was skipped."""
    return {"name": name, "value": value, "unit": unit, "goal": goal, "met": met}


def run_process(cmd: list[str], env: Mapping[str, str] | None = None) -> tuple[float, str]:
    """Seconds ``cmd`` takes from start to exit, run from the repository, and its stdout.

    Raises:
        SystemExit: the command failed; the message is its error's line (:func:`error_line`).
    """
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=REPO, env=None if env is None else dict(env),
                            capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[1:4])} failed (exit {result.returncode}): "
                         f"{error_line(result.stderr)[:1000]}")
    return seconds, result.stdout


_EXCEPTION = re.compile(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception|Interrupt)\b.*")


def error_line(stderr: str) -> str:
    """The line of ``stderr`` that names what failed.

    The last exception line other than torchrun's own ``ChildFailedError`` (a worker's
    ``[rankN]: RuntimeError: ...``); failing that, torchrun's ``exitcode`` line for a worker that
    died without one (a signal: ``exitcode : -6``); failing that, the last line that is not a
    rule of ``=`` or ``-``.
    """
    lines = [line.strip() for line in stderr.splitlines()]
    exceptions = [line for line in lines
                  if _EXCEPTION.match(line) and "ChildFailedError" not in line]
    if exceptions:
        return exceptions[-1]
    exits = [line for line in lines if line.startswith("exitcode")]
    if exits:
        return " ".join(exits[0].split())
    text = [line for line in lines if line.strip("=-")]
    return text[-1] if text else "(no output)"


def machine() -> dict[str, Any]:
    """What the numbers were measured on: CPU, cores, library versions, date."""
    import torch

    return {
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def emit(result: Mapping[str, Any]) -> None:
    """Print a benchmark's result as JSON: the last thing on stdout, so tools can parse it."""
    print(json.dumps(result, indent=2))
