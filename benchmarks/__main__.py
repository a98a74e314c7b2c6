"""`python -m benchmarks [--quick] [--only a,b]`: run every benchmark, print a table, write JSON.

Each benchmark module has ``main(argv) -> dict`` and alternates its sides itself; this runner
only calls them one after another, adds a description of the machine, writes everything to
``benchmarks/results.json`` and prints one line per headline ratio with its goal. A benchmark
that fails is reported as failed, the others still run, and the runner then exits non-zero.
With ``--only``, the file keeps the other benchmarks' last results (its table, all of them) and
the new ones replace theirs; the machine description is this run's.

``--quick`` checks that every benchmark runs, on sizes too small to say anything about speed:
it writes ``benchmarks/results.quick.json`` (ignored by git), never the tracked results of the
full runs, and leaves the goals unjudged ("-" in the table).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback
from pathlib import Path
from typing import Any

from benchmarks.common import machine, row
from trainkit.core.errors import one_line

# Run in this order.
NAMES = ("overhead", "flops_overhead", "mnist_e2e", "precision", "loaders", "image_folder",
         "checkpoint", "activation_memory", "activation_policies", "fsdp_memory", "cli_startup",
         "gpu")
DEFAULT_OUT = Path(__file__).resolve().parent / "results.json"
QUICK_OUT = DEFAULT_OUT.with_suffix(".quick.json")


def table(rows: list[dict[str, Any]]) -> str:
    width = max(len(r["name"]) for r in rows)
    lines = [f"{'benchmark':<{width}}  {'value':>9}  {'goal':<32} met?"]
    for r in rows:
        value = _fmt(r["value"], r.get("unit", "x")) if r["value"] is not None else (
            "failed" if r["met"] is False else "skipped")
        met = {True: "yes", False: "NO", None: "-"}[r["met"]]
        lines.append(f"{r['name']:<{width}}  {value:>9}  {r['goal']:<32} {met}")
    return "\n".join(lines)


def _fmt(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value:.1f} s"
    if unit == "acc":
        return f"{value:.4f}"
    return f"{value:.3f}{unit}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny runs: check they work")
    parser.add_argument("--only", default=",".join(NAMES),
                        help=f"comma-separated subset of {', '.join(NAMES)}")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"default: {DEFAULT_OUT.name}, or {QUICK_OUT.name} with --quick")
    args = parser.parse_args(argv)
    args.out = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    wanted = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = set(wanted) - set(NAMES)
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(sorted(unknown))}; have {', '.join(NAMES)}")
    results: dict[str, Any] = {"machine": machine(), "quick": args.quick, "benchmarks": {}}
    for name in wanted:
        print(f"== {name}", flush=True)
        try:
            run = importlib.import_module(f"benchmarks.{name}").main
            result = run(["--quick"] if args.quick else [])
        except SystemExit as err:  # a benchmark's own one-line reason
            result = _failed(name, str(err))
        except Exception as err:  # a bug: its traceback, and the other benchmarks still run
            traceback.print_exc()
            result = _failed(name, one_line(err))
        results["benchmarks"][name] = result
        if args.quick:  # tiny sizes measure nothing: a goal met or missed there means nothing
            result["rows"] = [{**r, "met": None} if r["value"] is not None else r
                              for r in result["rows"]]
    if set(wanted) != set(NAMES):  # --only: the other benchmarks' last results stay in the file
        results["benchmarks"] = {**_previous(args.out, args.quick), **results["benchmarks"]}
    results["table"] = [r for name in NAMES for r in results["benchmarks"].get(name, {}).get(
        "rows", [])]
    rows = [r for name in wanted for r in results["benchmarks"][name]["rows"]]
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print()
    print(table(rows))
    if args.quick:
        print("\nquick run: tiny sizes check that the benchmarks run; goals are not judged")
    print(f"\nresults written to {args.out}")
    failed = [name for name, result in results["benchmarks"].items() if "failed" in result]
    if failed:
        raise SystemExit(f"benchmarks failed: {', '.join(failed)} (reasons above and in "
                         f"{args.out})")
    return results


def _previous(path: Path, quick: bool) -> dict[str, Any]:
    """The benchmarks of the results file this run updates; none when it is missing, of the
    other kind (quick or full) or unreadable."""
    try:
        previous = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if previous.get("quick") != quick:
        return {}
    return {name: result for name, result in previous.get("benchmarks", {}).items()
            if name in NAMES}


def _failed(name: str, reason: str) -> dict[str, Any]:
    print(f"{name} failed: {reason}", file=sys.stderr, flush=True)
    return {"failed": reason, "rows": [row(name, None, "(failed: see results.json)", False)]}


if __name__ == "__main__":
    main()
