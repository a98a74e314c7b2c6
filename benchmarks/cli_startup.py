"""Start-up time of the ``trainkit`` console command: how long each quick command takes, start to
exit, against a bare ``python -c pass`` measured in the same rounds.

    python -m benchmarks.cli_startup              # 5 rounds
    python -m benchmarks.cli_startup --rounds 10

Timed: ``trainkit --help``, ``trainkit runs DIR`` (a folder of three small run dirs made here)
and ``trainkit env`` (which imports torch: its report is torch's view of the machine), each a
whole process as a user's shell would run it, sides alternating (``benchmarks.common``). The
console script is the one beside this interpreter (``python -m trainkit`` where none is
installed). Goal: ``--help`` and ``runs`` under one second.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import alternate, emit, median, row, run_process

GOAL_S = 1.0


def console_command() -> list[str]:
    """The installed ``trainkit`` script next to this Python, else ``python -m trainkit``."""
    script = Path(sys.executable).parent / "trainkit"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "trainkit"]


def make_runs(root: Path) -> Path:
    """Three run dirs as ``trainkit runs`` reads them (Hydra's files and a summary)."""
    for i, lr in enumerate(("0.1", "0.01", "0.001")):
        run = root / "runs" / str(i)
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "config.yaml").write_text("checkpoint: {monitor: val/acc}\n")
        (run / ".hydra" / "overrides.yaml").write_text(f"- optim.lr={lr}\n")
        (run / "summary.json").write_text(json.dumps(
            {"status": "completed", "global_step": 100, "metrics": {"val/acc": 0.9 + i / 100}}))
    return root / "runs"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one round: check that it runs")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    trainkit = console_command()
    with tempfile.TemporaryDirectory() as tmp:
        runs = make_runs(Path(tmp))
        commands = {"python -c pass": [sys.executable, "-c", "pass"],
                    "trainkit --help": [*trainkit, "--help"],
                    "trainkit runs DIR": [*trainkit, "runs", str(runs)],
                    "trainkit env": [*trainkit, "env"]}
        samples = alternate({name: lambda cmd=cmd: run_process(cmd)[0]
                             for name, cmd in commands.items()}, rounds)
    seconds = {name: median(samples, name) for name in commands}
    rows = [row(f"cli start-up: {name}", seconds[name], f"< {GOAL_S:g} s" if name in (
        "trainkit --help", "trainkit runs DIR") else "", seconds[name] < GOAL_S if name in (
        "trainkit --help", "trainkit runs DIR") else None, unit="s")
        for name in commands if name != "python -c pass"]
    result = {"rounds": rounds, "command": trainkit, "median_s": seconds, "samples": samples,
              "rows": rows}
    emit(result)
    return result


if __name__ == "__main__":
    main()
