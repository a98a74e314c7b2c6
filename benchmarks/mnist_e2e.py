"""Whole-process time and test accuracy of `python -m trainkit.train +exp=mnist`.

    python -m benchmarks.mnist_e2e --repeats 3          # real MNIST under TRAINKIT_DATA_DIR
    python -m benchmarks.mnist_e2e --quick              # generated files, a few steps

Times the full command from process start to exit (interpreter, imports, data, training,
evaluation, checkpoint), as a user would with `time`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_once(data_root: str, run_dir: Path, extra: list[str]) -> dict:
    env = dict(os.environ, TRAINKIT_DATA_DIR=data_root)
    cmd = [sys.executable, "-m", "trainkit.train", "+exp=mnist", f"hydra.run.dir={run_dir}", *extra]
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"training failed: {result.stderr.strip()[-500:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"process_s": seconds, "train_s": summary["wall_time_s"],
            "val_acc": summary["metrics"]["val/acc"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="generated data, a few steps")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        extra: list[str] = []
        data_root = os.environ.get("TRAINKIT_DATA_DIR", "./data")
        if args.quick:
            sys.path.insert(0, str(REPO))
            from tests.fakes import write_fake_mnist

            data_root = str(write_fake_mnist(Path(tmp) / "data"))
            extra = ["data.verify=false", "data.download=false", "trainer.max_steps=5"]
            args.repeats = 1
        runs = [run_once(data_root, Path(tmp) / f"run{i}", extra) for i in range(args.repeats)]
    result = {
        "benchmark": "mnist_e2e",
        "command": "python -m trainkit.train +exp=mnist",
        "runs": runs,
        "median_process_s": statistics.median(r["process_s"] for r in runs),
        "min_val_acc": min(r["val_acc"] for r in runs),
        "goal": "val/acc >= 0.990 and whole process <= 12 s (2-core CPU)",
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
