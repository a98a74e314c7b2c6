"""Trainer overhead: steps/s of `Trainer.fit` against a hand-written loop doing the same work.

    python -m benchmarks.overhead            # ratio = trainer / loop steps per second
    python -m benchmarks.overhead --quick

Same tiny MLP, same in-memory batches, same optimizer, same number of steps, fp32 on the CPU,
where per-step overhead shows most. Each round runs loop, trainer, trainer, loop, and the result is
the median of the rounds' ratios, so machine noise hits both sides. Goal: ratio >= 0.98.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from trainkit import CheckpointConfig, Trainer, TrainerConfig


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def make_batches(steps: int, batch: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, 32, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(steps)]


def hand_written(batches: list) -> float:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    start = time.perf_counter()
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return len(batches) / (time.perf_counter() - start)


def with_trainer(batches: list) -> float:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    trainer = Trainer(TrainerConfig(device="cpu", max_epochs=1, log_every_n_steps=100),
                      checkpoint=CheckpointConfig(resume=None, save_last=False))
    start = time.perf_counter()
    trainer.fit(model, optimizer, batches)
    return len(batches) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; 1 keeps thread-pool wake-ups out of a tiny model")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = 50, 1
    torch.set_num_threads(args.threads)
    batches = make_batches(args.steps)
    hand_written(batches[:50])  # warm up allocator and kernels for both sides
    with_trainer(batches[:50])
    loop, trainer, ratios = [], [], []
    for _ in range(args.rounds):
        # loop, trainer, trainer, loop: drift in machine load within a round cancels out
        a1, b1, b2, a2 = (hand_written(batches), with_trainer(batches), with_trainer(batches),
                          hand_written(batches))
        loop += [a1, a2]
        trainer += [b1, b2]
        ratios.append((b1 + b2) / (a1 + a2))
    result = {
        "benchmark": "overhead",
        "loop_steps_per_s": statistics.median(loop),
        "trainer_steps_per_s": statistics.median(trainer),
        "ratio": statistics.median(ratios),
        "steps": args.steps, "rounds": args.rounds, "threads": args.threads,
        "goal": "ratio >= 0.98",
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
