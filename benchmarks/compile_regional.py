"""``trainer.compile=regional`` against whole-model ``torch.compile`` on the built-in GPT.

    python -m benchmarks.compile_regional         # whole, regional, regional, whole; + eager
    python -m benchmarks.compile_regional --quick

``+exp=lm``'s GPT (dim 128, 4 layers, 4 heads, 256 tokens of context; batch 8 by default)
trains ``--steps`` AdamW steps on the same random token batches, compiled as
:func:`trainkit.distributed.strategy.compiled` compiles it for ``trainer.compile=true`` (the
whole model) and ``=regional`` (each Block, one compile for the class). Each run is a fresh
process with an empty inductor cache folder of its own (a cold start: nothing compiled by an
earlier run is reused), the sides alternating (whole, regional, regional, whole per round);
one eager run gives the reference losses.

Figures: the first step's seconds (tracing, code generation and the step itself: the cold
start a user waits for), the steady step time (median of the steps after the first three),
and each step's loss. Ratios: regional / whole first step (goal < 1) and steady step (context:
the eager code between the blocks is not fused); the largest difference between the regional
and whole runs' losses at any step, and between each and eager (goal: the same trajectory).
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

import torch

from benchmarks.common import REPO, alternate, emit, median, ratio, row

_WARM = 3  # steps left out of the steady step time


def one_run(mode: str, dim: int, layers: int, seq: int, batch: int, steps: int) -> dict:
    """In this process: train ``steps`` steps compiled as ``mode`` (``eager``, ``whole``,
    ``regional``); the first step's seconds, the steady step time and the losses."""
    from trainkit.distributed import strategy
    from trainkit.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(dim=dim, layers=layers, heads=4, block=seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (batch, seq + 1), generator=g) for _ in range(steps)]
    run = model if mode == "eager" else strategy.compiled(
        model, True if mode == "whole" else "regional")
    seconds, losses = [], []
    for tokens in batches:
        started = time.perf_counter()
        logits = run(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # CPU: the step is done; CUDA: this read waits for it
        seconds.append(time.perf_counter() - started)
    return {"first_step_s": seconds[0], "steady_step_s": statistics.median(seconds[_WARM:]),
            "losses": losses}


def _in_subprocess(mode: str, args: argparse.Namespace, runs: list[dict]) -> float:
    """One run in a fresh process with an empty inductor cache; its first step's seconds."""
    code = ("import json; from benchmarks.compile_regional import one_run; print(json.dumps("
            f"one_run({mode!r}, {args.dim}, {args.layers}, {args.seq}, {args.batch}, "
            f"{args.steps})))")
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(REPO)}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             cwd=REPO, env=env)
    if out.returncode:
        raise SystemExit(f"{mode} run failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    runs.append({"mode": mode, **result})
    return result["first_step_s"]


def _largest_difference(runs: list[dict], a: str, b: str) -> float:
    """The largest |loss difference| at any step between any run of ``a`` and any of ``b``."""
    return max(abs(x - y) for ra in runs if ra["mode"] == a for rb in runs if rb["mode"] == b
               for x, y in zip(ra["losses"], rb["losses"]))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.dim, args.layers, args.seq, args.batch, args.steps = 32, 2, 16, 2, 5
    runs: list[dict] = []
    _in_subprocess("eager", args, runs)
    first = alternate({mode: lambda mode=mode: _in_subprocess(mode, args, runs)
                       for mode in ("whole", "regional")}, args.rounds)
    steady = {mode: [[r["steady_step_s"] for r in runs if r["mode"] == mode]]
              for mode in ("whole", "regional")}
    result = {
        "benchmark": "compile_regional",
        "device": "cpu",
        "whole_first_step_s": median(first, "whole"),
        "regional_first_step_s": median(first, "regional"),
        "regional_vs_whole_first_step": ratio(first, "regional", "whole"),
        "whole_steady_step_ms": 1000 * median(steady, "whole"),
        "regional_steady_step_ms": 1000 * median(steady, "regional"),
        "eager_steady_step_ms": 1000 * next(r["steady_step_s"] for r in runs
                                            if r["mode"] == "eager"),
        "regional_vs_whole_steady_step": ratio(steady, "regional", "whole"),
        "loss_max_diff_regional_vs_whole": _largest_difference(runs, "regional", "whole"),
        "loss_max_diff_regional_vs_eager": _largest_difference(runs, "regional", "eager"),
        "loss_max_diff_whole_vs_eager": _largest_difference(runs, "whole", "eager"),
        "runs": runs,
        "dim": args.dim, "layers": args.layers, "seq": args.seq, "batch": args.batch,
        "steps": args.steps, "rounds": args.rounds, "threads": torch.get_num_threads(),
    }
    same = result["loss_max_diff_regional_vs_whole"]
    result["rows"] = [
        row("compile=regional: first step / whole-model compile",
            result["regional_vs_whole_first_step"], "< 1 (cold start)",
            result["regional_vs_whole_first_step"] < 1),
        row("compile=regional vs whole: largest loss difference", same, "< 1e-3 (same losses)",
            same < 1e-3, unit=" nats"),
    ]
    emit(result)
    return result


if __name__ == "__main__":
    main()
