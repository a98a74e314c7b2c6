"""The first step's seconds and the steady step time a run's summary carries."""

from __future__ import annotations

from typing import Any

import torch

from trainkit.loop.step_times import StepTimes


class _Run:
    """What StepTimes needs of a run: its step (a run is weakly referenced)."""

    def __init__(self, step: Any) -> None:
        self.step = step


def test_the_first_step_is_timed_once_and_left_out_of_the_steady_time() -> None:
    times, calls = StepTimes(torch.device("cpu")), []
    run = _Run(lambda *args: calls.append(args) or "result")
    inner = run.step
    times.time_first(run, done_steps=10)  # a resumed run: its first step is step 11
    assert run.step is not inner and run.step(1, 2) == "result"
    assert run.step is inner and calls == [(1, 2)]  # handed back: no cost after the first step
    times.first_step_s = 2.0  # the measured value, made round for the arithmetic below
    times.window({"time/step_ms": 1000 * (2.0 + 3 * 0.1) / 4}, step=14)  # steps 11-14
    times.window({"time/step_ms": 120.0}, step=18)
    times.window({"time/step_ms": 110.0}, step=22)
    times.window({"time/step_ms": 999.0}, step=20)  # a rollback: not counted
    summary = times.summary()
    assert summary["first_step_s"] == 2.0
    assert abs(summary["steady_step_s"] - 0.11) < 1e-9  # median of 0.1, 0.12, 0.11


def test_no_steady_time_when_only_the_first_step_was_logged() -> None:
    times = StepTimes(torch.device("cpu"), compile_mode="regional")
    times.first_step_s = 1.5
    times.window({"time/step_ms": 1500.0}, step=1)
    assert times.summary() == {"first_step_s": 1.5, "steady_step_s": None}


def test_what_the_first_call_spends_not_training_is_left_out_of_its_seconds() -> None:
    """The one-off FLOP count runs inside the first step: the step meter leaves it out of the
    window, so the first step's seconds must leave it out too (else the steady time is low)."""
    import time

    spent = [0.0]

    def step() -> None:  # nothing but the count: 0.2 s of it, as the FLOPs meter reports it
        started = time.perf_counter()
        time.sleep(0.2)
        spent[0] += time.perf_counter() - started

    times = StepTimes(torch.device("cpu"))
    run = _Run(step)
    times.time_first(run, done_steps=0, not_training=lambda: spent[0])
    run.step()
    assert times.first_step_s is not None and 0 <= times.first_step_s < 0.1  # 0.2 without it
