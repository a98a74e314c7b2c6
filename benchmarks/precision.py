"""Precision: `32` vs `bf16-mixed` training steps of both experiments' models, on this machine.

    python -m benchmarks.precision            # ratios of step time, bf16-mixed / 32
    python -m benchmarks.precision --quick

``trainer.precision=auto`` picks by a rule (:func:`trainkit.loop.precision.choose_precision`): on a
CPU, bf16-mixed only with native bf16 instructions (AVX512-BF16 or AMX). This checks the rule
against a measurement on the machine it runs on: for each experiment's model (``+exp=mnist``'s
MnistNet, batch 256; ``+exp=cifar``'s CifarNet, batch 512, both channels_last) it times the
same training steps (trainkit's step: forward, loss, backward, optimizer step, the experiment's
optimizer) in each precision, in the same process, alternating 32, bf16, bf16, 32 each round;
the ratio is the median over rounds. Goal: ``auto`` picks the faster of the two for both models.
Runs on the CPU (a CUDA machine's choice is by compute capability, and bf16 there is not in
question).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import alternate, emit, median, ratio, row
from trainkit.loop.precision import Hardware, Precision, choose_precision
from trainkit.loop.step import WindowStep, default_forward
from trainkit.models import CifarNet, MnistNet

MODES = ("32", "bf16-mixed")
# name -> (model, input shape, batch, optimizer) as the experiments configure them
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], tuple[int, ...], int, Any]] = {
    "mnist": (MnistNet, (1, 28, 28), 256,
              lambda p: torch.optim.AdamW(p, lr=0.02, weight_decay=0.01, fused=True)),
    "cifar": (CifarNet, (3, 32, 32), 512,
              lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9, nesterov=True,
                                        weight_decay=5e-4)),
}


def stepper(name: str, mode: str, batch: int, steps: int) -> Callable[[], float]:
    """A callable that trains ``steps`` steps of ``name``'s model in ``mode``; returns seconds."""
    make, shape, _, optimizer = MODELS[name]
    torch.manual_seed(0)
    model = make().to(memory_format=torch.channels_last)
    x = torch.randn(batch, *shape).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,))
    step = WindowStep(model, optimizer=optimizer(model.parameters()),
                      precision=Precision(mode, "cpu"), criterion=F.cross_entropy,
                      forward=default_forward, device=torch.device("cpu"))
    step([(x, y)])  # first-call costs (oneDNN primitives, optimizer state) outside the clock

    def run() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            step([(x, y)])
        return time.perf_counter() - start

    return run


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per measurement; default 20 for mnist, 4 for cifar")
    parser.add_argument("--quick", action="store_true", help="tiny batches, few steps")
    args = parser.parse_args(argv)
    auto, why = choose_precision(Hardware.of("cpu"))
    result: dict[str, Any] = {"benchmark": "precision", "auto": auto, "auto_reason": why,
                              "quick": args.quick, "models": {}, "rows": []}
    for name, (_, _, batch, _) in MODELS.items():
        steps = args.steps or {"mnist": 20, "cifar": 4}[name]
        if args.quick:
            batch, steps, args.rounds = 8, 2, 1
        sides = {mode: stepper(name, mode, batch, steps) for mode in MODES}
        samples = alternate(sides, args.rounds)
        slower = ratio(samples, "bf16-mixed", "32")  # < 1: bf16 is faster
        faster = "bf16-mixed" if slower < 1 else "32"
        result["models"][name] = {
            "batch": batch, "steps": steps, "samples": samples, "bf16/32": slower,
            "ms_per_step": {m: 1e3 * median(samples, m) / steps for m in MODES},
            "faster": faster,
        }
        result["rows"].append(row(f"precision: {name} step time bf16-mixed/32", slower,
                                  f"auto ({auto}) picks the faster", auto == faster))
    result["goal"] = "auto picks the faster of 32 and bf16-mixed for both experiments' models"
    for name, r in result["models"].items():
        print(f"{name}: bf16-mixed/32 step time {r['bf16/32']:.3f} ({r['faster']} faster); "
              f"auto picks {auto} here ({why})")
    emit(result)
    return result


if __name__ == "__main__":
    main()
