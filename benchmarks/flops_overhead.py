"""What counting FLOPs (MFU) costs a run: `Trainer.fit` counting, not counting, and a plain loop.

    python -m benchmarks.flops_overhead            # the overhead benchmark's MLP, 500 steps
    python -m benchmarks.flops_overhead --model gpt --steps 60
    python -m benchmarks.flops_overhead --quick

Three sides train the same model on the same in-memory batches with the same SGD, fp32 on the CPU
with one thread: a hand-written loop, ``Trainer.fit`` as it runs (its first step counts the
model's FLOPs on a meta copy: :mod:`trainkit.observe.flops`), and ``Trainer.fit`` with the
counting left out (``FlopsMeter.watch`` made a no-op, as before MFU existed).
``trainer.peak_tflops`` is given to both trainkit sides, so no side measures a matmul (that is
once per process; reported apart, in ms). Each round runs loop, counted, uncounted, uncounted,
counted, loop (:func:`benchmarks.common.alternate`).

Reported: steps/s over whole fits (the one-off count included) and over their second halves
(the steady step, where counting does nothing), as ratios counted/uncounted and counted/loop;
the one-off count itself in ms (the meta copy and the counted forward and backward, timed alone,
median of repetitions) and the CPU's matmul peak measurement in ms.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import alternate, emit, median, ratio, row
from trainkit import CheckpointConfig, Trainer, TrainerConfig
from trainkit.observe import flops
from trainkit.observe.flops import FlopsMeter

Batches = list[tuple[torch.Tensor, torch.Tensor]]
GOAL = 0.99  # counted / uncounted, second halves: nothing measurable


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        from trainkit.models.gpt import GPT

        return GPT(vocab_size=256, block=64, dim=128, layers=4, heads=4)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def make_batches(kind: str, steps: int) -> Batches:
    g = torch.Generator().manual_seed(0)
    if kind == "gpt":  # token windows: inputs, next tokens
        tokens = [torch.randint(0, 256, (16, 65), generator=g) for _ in range(steps)]
        return [(t[:, :-1], t[:, 1:]) for t in tokens]
    return [(torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g))
            for _ in range(steps)]


def loss_of(kind: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if kind == "gpt":
        return lambda logits, targets: F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return F.cross_entropy


def hand_written(kind: str, batches: Batches, halves: list[float]) -> float:
    """Steps/s of the plain loop; its second half's rate appended to ``halves``."""
    model, criterion = make_model(kind), loss_of(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    half = len(batches) // 2
    start = half_at = time.perf_counter()
    for i, (x, y) in enumerate(batches):
        if i == half:
            half_at = time.perf_counter()
        loss = criterion(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    end = time.perf_counter()
    halves.append((len(batches) - half) / (end - half_at))
    return len(batches) / (end - start)


class HalfClock:
    """When ``fit`` finished step ``half``."""

    def __init__(self, half: int) -> None:
        self.half, self.at = half, 0.0

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        if step == self.half:
            self.at = time.perf_counter()


def with_trainkit(kind: str, batches: Batches, halves: list[float], *, count: bool) -> float:
    """Steps/s of ``Trainer.fit`` (nothing written), counting FLOPs or not."""
    model, criterion = make_model(kind), loss_of(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    clock = HalfClock(len(batches) // 2)
    trainer = Trainer(TrainerConfig(device="cpu", max_epochs=1, log_every_n_steps=100,
                                    peak_tflops=1.0, advice=False),
                      checkpoint=CheckpointConfig(resume=None, save_last=False),
                      callbacks=[clock])
    watch = FlopsMeter.watch
    if not count:  # the fit as it ran before MFU existed
        FlopsMeter.watch = lambda self, model: None  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        summary = trainer.fit(model, optimizer, batches, criterion=criterion)
        end = time.perf_counter()
    finally:
        FlopsMeter.watch = watch  # type: ignore[method-assign]
    assert ("flops_per_sample" in summary) == count, "the side did not (not) count"
    halves.append((len(batches) - clock.half) / (end - clock.at))
    return len(batches) / (end - start)


def one_off_ms(kind: str, repeats: int) -> dict[str, float]:
    """The count alone (the meta copy, its forward and backward under the counter; not the
    step's own forward, which runs anyway) and the CPU's matmul peak."""
    model, batches = make_model(kind), make_batches(kind, 1)
    inputs = batches[0][0]
    times = []
    for _ in range(repeats + 1):  # the first: lazy imports, first-call costs
        started = time.perf_counter()
        meter = FlopsMeter(model, torch.device("cpu"), "32", peak_tflops=1.0)
        meter.count((inputs,), {}, samples=inputs.shape[0])
        times.append(time.perf_counter() - started)
    flops._measured.clear()  # measured again, as a new process would
    started = time.perf_counter()
    flops.measure_matmul_tflops(torch.device("cpu"), "fp32")
    return {"count_ms": 1000 * statistics.median(times[1:]),
            "matmul_peak_ms": 1000 * (time.perf_counter() - started)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="a few steps: check it works")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = 20, 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = _measure(args.model, args.steps, args.rounds)
    finally:
        torch.set_num_threads(threads)
    emit(result)
    return result


def _measure(kind: str, steps: int, rounds: int) -> dict[str, Any]:
    batches = make_batches(kind, steps)
    halves: dict[str, list[float]] = {"loop": [], "counted": [], "uncounted": []}
    sides = {"loop": lambda: hand_written(kind, batches, halves["loop"]),
             "counted": lambda: with_trainkit(kind, batches, halves["counted"], count=True),
             "uncounted": lambda: with_trainkit(kind, batches, halves["uncounted"], count=False)}
    for side in sides.values():  # warm-up: lazy imports, allocator, kernels
        side()
    for kept in halves.values():
        kept.clear()
    samples = alternate(sides, rounds)
    by_round = {name: [kept[i:i + 2] for i in range(0, len(kept), 2)]
                for name, kept in halves.items()}
    once = one_off_ms(kind, repeats=5)
    ratios = {"counted/uncounted": ratio(samples, "counted", "uncounted"),
              "counted/uncounted, second halves": ratio(by_round, "counted", "uncounted"),
              "counted/loop": ratio(samples, "counted", "loop")}
    label = f"flops ({kind}, {steps} steps)"
    steady = ratios["counted/uncounted, second halves"]
    return {
        "benchmark": "flops_overhead", "model": kind, "steps": steps, "rounds": rounds,
        "steps_per_s": {name: median(samples, name) for name in samples},
        "ratios": ratios, **once, "samples": samples,
        "rows": [row(f"{label}: counted/uncounted steps/s, second halves", steady, f">= {GOAL}",
                     steady >= GOAL),
                 row(f"{label}: counted/uncounted steps/s, whole fits",
                     ratios["counted/uncounted"], "(context: one-off count)", None),
                 row(f"{label}: counted/loop steps/s", ratios["counted/loop"], "(context)",
                     None),
                 row(f"{label}: the one-off count", once["count_ms"], "(context)", None,
                     unit="ms"),
                 row("flops: the CPU's matmul peak, once per process", once["matmul_peak_ms"],
                     "(context)", None, unit="ms")],
    }


if __name__ == "__main__":
    main()
