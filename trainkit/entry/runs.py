"""``trainkit runs DIR``: one table of every run dir under DIR, the best run first.

A run dir is a folder with Hydra's ``.hydra/config.yaml`` (what the entry point writes first).
Each row: the run's overrides that differ between the runs (``optim.lr``), its status and step
(``summary.json``; ``running?`` without one: still running, or killed), its monitored metric
(``checkpoint.monitor``, best first by ``checkpoint.mode``), its best checkpoint's value and step
(summary.json's ``best``), then its other metrics; a ``failed`` run's error line comes last.
``--csv`` prints the same as comma-separated values, for scripts: numbers in full precision, one
value per column (the best checkpoint's value and step apart).
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainkit.core.errors import TrainkitError, command_name, print_error
from trainkit.observe.summary import read_summary


@dataclass
class RunRow:
    """What the table shows of one run dir."""

    path: Path
    overrides: dict[str, str]
    status: str
    step: int | None
    monitor: str | None
    mode: str
    metrics: dict[str, float]
    best: dict[str, Any] | None = None  # summary.json's: {metric, value, step, path}
    error: str = ""  # a failed run's error line

    @property
    def value(self) -> float | None:
        """The monitored metric, or None where the run has none (yet)."""
        value = self.metrics.get(self.monitor) if self.monitor else None
        return None if value is None or math.isnan(value) else float(value)


def find_runs(root: Path) -> list[RunRow]:
    """Every run dir under ``root`` (``root`` itself included), in path order."""
    import yaml  # Hydra's (and OmegaConf's) dependency

    runs = []
    for config_file in sorted(root.glob("**/.hydra/config.yaml")):
        path = config_file.parent.parent
        try:
            config = yaml.safe_load(config_file.read_text()) or {}
            listed = yaml.safe_load((path / ".hydra" / "overrides.yaml").read_text()) or []
        except (OSError, yaml.YAMLError):
            continue  # being written, or not Hydra's
        checkpoint = config.get("checkpoint") or {}
        summary = read_summary(path) or {}
        runs.append(RunRow(
            path=path, overrides=dict(_split(o) for o in listed if not o.startswith("hydra.")),
            status=summary.get("status", "running?"), step=summary.get("global_step"),
            monitor=checkpoint.get("monitor"), mode=checkpoint.get("mode", "max"),
            metrics={k: v for k, v in (summary.get("metrics") or {}).items()
                     if isinstance(v, (int, float))},
            best=summary.get("best") or None, error=str(summary.get("error") or "")))
    return runs


def _split(override: str) -> tuple[str, str]:
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value


def best_first(runs: list[RunRow]) -> list[RunRow]:
    """Runs with a monitored value first, best first by each run's mode; then the others."""
    def key(run: RunRow) -> tuple[int, float, str]:
        if run.value is None:
            return (1, 0.0, str(run.path))
        return (0, -run.value if run.mode == "max" else run.value, str(run.path))
    return sorted(runs, key=key)


def table(runs: list[RunRow], root: Path, *, full: bool = False
          ) -> tuple[list[str], list[list[str]]]:
    """The header and rows: run, differing overrides, status, step, monitor, other metrics.

    ``full`` (``--csv``): each number in full precision (``repr``) and one value per column (the
    best checkpoint's value and step in two); else 6 significant digits, ``best (step)`` in one.
    """
    number = _full if full else _number
    keys = sorted({k for run in runs for k in run.overrides})
    differing = [k for k in keys if len({run.overrides.get(k) for run in runs}) > 1]
    monitors = sorted({run.monitor for run in runs if run.monitor})
    others = sorted({m for run in runs for m in run.metrics} - set(monitors))
    has_best = any(run.best for run in runs)
    best = (["best", "best step"] if full else ["best (step)"]) if has_best else []
    error = ["error"] if any(run.error for run in runs) else []
    header = ["run", *differing, "status", "step", *monitors, *best, *others, *error]
    rows = []
    for run in best_first(runs):
        name = str(run.path.relative_to(root)) if run.path != root else "."
        shown_best = [] if not has_best else (
            [number((run.best or {}).get("value")), str((run.best or {}).get("step", ""))]
            if full else [_best(run.best)])
        rows.append([name, *(run.overrides.get(k, "") for k in differing), run.status,
                     "" if run.step is None else str(run.step),
                     *(number(run.metrics.get(m)) for m in monitors), *shown_best,
                     *(number(run.metrics.get(m)) for m in others),
                     *([run.error] if error else [])])
    return header, rows


def _best(best: dict[str, Any] | None) -> str:
    return f"{_number(best.get('value'))} ({best.get('step')})" if best else ""


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"


def _full(value: float | None) -> str:
    """A number as Python writes it back exactly (``0.6046813726425171``)."""
    return "" if value is None else repr(value)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table of the run dirs under DIR."""
    parser = argparse.ArgumentParser(
        prog=command_name("trainkit.entry.runs"),
        description="A table of every run dir under DIR (a sweep, a multirun, any folder of "
                    "runs): the overrides that differ, status, step and metrics, best first.")
    parser.add_argument("dir", type=Path, help="a folder holding run dirs")
    parser.add_argument("--csv", action="store_true", help="comma-separated values")
    args = parser.parse_args(argv)
    try:
        if not args.dir.is_dir():
            raise TrainkitError(f"{args.dir} is not a folder: give the folder that holds the "
                                "run dirs (a sweep's --dir, multirun/<date>/<time>, outputs)")
        runs = find_runs(args.dir)
        if not runs:
            raise TrainkitError(f"no run dirs under {args.dir} (folders with .hydra/config.yaml"
                                "): give the folder that holds them")
    except TrainkitError as err:
        print_error(str(err), err.details)
        return 2
    header, rows = table(runs, args.dir, full=args.csv)
    if args.csv:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerows([header, *rows])
        return 0
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    for line in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
