"""Whole process: `python -m trainkit.train +exp=mnist` vs the same recipe written by hand.

    python -m benchmarks.mnist_e2e                      # real MNIST under TRAINKIT_DATA_DIR
    python -m benchmarks.mnist_e2e --seeds 0            # one seed, one round
    python -m benchmarks.mnist_e2e --quick              # generated files, a few steps

Both sides are timed the same way, from process start to exit (interpreter, imports, data,
training, evaluation; trainkit also composes its config, verifies the files' checksums, logs,
writes TensorBoard events, its checkpoint and summary), as a user would with `time`. The hand
side is ``benchmarks/hand_mnist.py``: the same net, batch, steps, optimizer, schedule, loss,
precision and data with the usual parts (torchvision's reader, ``torch.optim.AdamW``,
``OneCycleLR``, torchmetrics' accuracy) and a plain exit. Each round runs trainkit, hand, hand,
trainkit; the ratio is the median over rounds of trainkit time / hand time, which cancels the load
of other users of a shared machine as far as it drifts slowly. Both sides run on the CPU with
torch's default thread settings, at the precision trainkit's ``auto`` picks here, and take their
seed from ``--seeds`` in turn (each run a whole process); the rounds default to enough for every
seed to run once on each side, so the minimum accuracy is over all of them. Goal: trainkit's whole
process <= 1.10x the hand-written script's (median), every seed >= 99.0% test accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import alternate, emit, median, ratio, row, run_process

GOAL_RATIO, GOAL_ACC = 1.10, 0.990


def run_trainkit(data_root: str, run_dir: Path, extra: list[str]) -> dict[str, float]:
    env = dict(os.environ, TRAINKIT_DATA_DIR=data_root)
    cmd = [sys.executable, "-m", "trainkit.train", "+exp=mnist", "trainer.device=cpu",
           f"hydra.run.dir={run_dir}", *extra]
    seconds, _ = run_process(cmd, env)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"process_s": seconds, "startup_s": summary["startup_s"],
            "train_s": summary["wall_time_s"], "val_acc": summary["metrics"]["val/acc"]}


def run_hand(data_root: str, extra: list[str]) -> dict[str, float]:
    cmd = [sys.executable, "-m", "benchmarks.hand_mnist", "--data-root", data_root, *extra]
    seconds, stdout = run_process(cmd)
    return {"process_s": seconds, **json.loads(stdout.strip().splitlines()[-1])}


def auto_precision() -> str:
    """What trainer.precision=auto runs on this machine's CPU (the hand side does the same)."""
    from trainkit.loop.precision import Hardware, choose_precision

    return choose_precision(Hardware.of("cpu"))[0]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of trainkit, hand, hand, trainkit; default: enough for "
                             "each seed to run once on each side")
    parser.add_argument("--seeds", default="0,1,2,3,4",
                        help="comma-separated seeds, taken in turn by each side's runs")
    parser.add_argument("--quick", action="store_true", help="generated data, a few steps")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.rounds = args.rounds or -(-len(seeds) // 2)  # two runs of each side a round
    precision = auto_precision()
    with tempfile.TemporaryDirectory() as tmp:
        data_root = os.environ.get("TRAINKIT_DATA_DIR", "./data")
        trainkit_extra: list[str] = []
        hand_extra = ["--precision", precision]
        if args.quick:
            from tests.helpers.fakes import write_fake_mnist

            data_root = str(write_fake_mnist(Path(tmp) / "data"))
            trainkit_extra = ["data.verify=false", "data.download=false", "trainer.max_steps=5",
                              "data.batch_size=32"]
            hand_extra += ["--steps", "5", "--batch-size", "32"]
            args.rounds = 1
        runs: dict[str, list[dict[str, float]]] = {"trainkit": [], "hand": []}

        def trainkit() -> float:
            done = len(runs["trainkit"])
            seed = seeds[done % len(seeds)]
            runs["trainkit"].append({"seed": seed, **run_trainkit(
                data_root, Path(tmp) / f"run{done}", [*trainkit_extra, f"trainer.seed={seed}"])})
            return runs["trainkit"][-1]["process_s"]

        def hand() -> float:
            seed = seeds[len(runs["hand"]) % len(seeds)]
            runs["hand"].append({"seed": seed, **run_hand(
                data_root, [*hand_extra, "--seed", str(seed)])})
            return runs["hand"][-1]["process_s"]

        samples = alternate({"trainkit": trainkit, "hand": hand}, args.rounds)
    slower = ratio(samples, "trainkit", "hand")
    acc = {side: [r["val_acc"] for r in side_runs] for side, side_runs in runs.items()}
    result = {
        "benchmark": "mnist_e2e",
        "commands": {"trainkit": "python -m trainkit.train +exp=mnist trainer.device=cpu",
                     "hand": f"python -m benchmarks.hand_mnist --data-root $TRAINKIT_DATA_DIR "
                             f"--precision {precision}"},
        "precision": precision,
        "runs": runs,
        "samples": samples,
        "ratio": slower,
        "median_process_s": {side: median(samples, side) for side in samples},
        "median_startup_s": statistics.median(r["startup_s"] for r in runs["trainkit"]),
        "val_acc": {side: statistics.median(values) for side, values in acc.items()},
        "min_val_acc": {side: min(values) for side, values in acc.items()},
        "quick": args.quick,
        "seeds": seeds,
        "goal": f"trainkit's whole process <= {GOAL_RATIO:g}x the hand-written script's "
                f"(median over rounds), val/acc >= {GOAL_ACC} for every seed",
        "rows": [
            row("mnist: trainkit/hand whole process", slower, f"<= {GOAL_RATIO:g}",
                slower <= GOAL_RATIO),
            row("mnist: trainkit whole process, median", median(samples, "trainkit"),
                f"(hand: {median(samples, 'hand'):.1f} s)", None, unit="s"),
            row(f"mnist: trainkit min test acc, seeds {args.seeds}", min(acc["trainkit"]),
                f">= {GOAL_ACC} (hand: {min(acc['hand']):.4f})",
                min(acc["trainkit"]) >= GOAL_ACC, unit="acc"),
        ],
    }
    emit(result)
    return result


if __name__ == "__main__":
    main()
