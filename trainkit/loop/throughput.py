"""Timed phases for ``trainkit probe``: the loader alone, the step alone, the two as fit runs them.

Each phase warms up, times a few calls to learn how long one takes, then times as many calls as
fill the requested seconds (under torchrun every rank runs the same number: a step all-reduces).
The figures come from the same :class:`~trainkit.observe.metrics.StepMeter` the Trainer logs
with, and the steps are the Trainer's own :class:`~trainkit.loop.step.WindowStep`, so the
"together" phase is the figure a run's ``train.log`` shows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import psutil
import torch

from trainkit.core.device import GIB, move_to_device
from trainkit.core.errors import TrainkitError
from trainkit.data.loader.resumable import pass_of
from trainkit.distributed import group
from trainkit.loop.step import WindowStep, batch_size, windows
from trainkit.observe.metrics import StepMeter


@dataclass
class Phase:
    """One timed phase's figures."""

    name: str
    samples_per_s: float
    steps_per_s: float  # batches per second for the loader alone
    data_wait_share: float | None  # of the phase's time blocked on the next batch (together)
    peak_gib: float  # CUDA: peak allocated; CPU: the process's resident memory at the end
    peak_share: float  # of the device's memory (CPU: of the machine's RAM)
    seconds: float
    steps: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def device_memory_gib(device: torch.device) -> float:
    """The memory a run can fill: the GPU's total on CUDA, the machine's RAM elsewhere."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / GIB
    return psutil.virtual_memory().total / GIB


def cycle(data: Iterable[Any]) -> Iterator[Any]:
    """``data``'s batches epoch after epoch (each pass told its epoch, as fit does)."""
    epoch = 0
    while True:
        empty = True
        for batch in pass_of(data, epoch, 0):
            empty = False
            yield batch
        if empty:
            raise TrainkitError("the training data yields no batches: check data.batch_size "
                                "against the dataset's size (and drop_last)")
        epoch += 1


def loader_phase(data: Iterable[Any], device: torch.device, *, seconds: float,
                 name: str = "loader", warmup: int = 2) -> Phase:
    """Batches per second from ``data``, each on ``device`` (trainkit's loaders put it there)."""
    batches = cycle(data)

    def one(meter: StepMeter) -> None:
        batch = move_to_device(next(batches), device)  # no copy when it is there already
        meter.add(batch_size(batch))

    return timed(name, one, device, seconds=seconds, warmup=warmup)


def step_phase(step: WindowStep, batch: Any, *, seconds: float, guard_finite: bool,
               warmup: int = 2) -> Phase:
    """Optimizer steps per second on one batch kept on the device: no loading at all."""
    window = (move_to_device(batch, step.device),)

    def one(meter: StepMeter) -> None:
        result = step(window, False, guard_finite)
        meter.add(result.samples, result.logged_loss, None, result.finite_flag)  # as fit does

    return timed("step", one, step.device, seconds=seconds, warmup=warmup)


def together_phase(step: WindowStep, data: Iterable[Any], *, accumulate: int, seconds: float,
                   guard_finite: bool, warmup: int = 2) -> Phase:
    """Loading and stepping as ``Trainer.fit`` interleaves them, with its data-wait clock."""
    groups = windows(cycle(data), accumulate)
    clock = time.perf_counter

    def one(meter: StepMeter) -> None:
        fetched = clock()
        window = next(groups)
        meter.data_wait += clock() - fetched  # blocked on the data, as fit counts it
        result = step(window, False, guard_finite)
        meter.add(result.samples, result.logged_loss, None, result.finite_flag)  # as fit does

    return timed("together", one, step.device, seconds=seconds, warmup=warmup, waits=True)


def timed(name: str, one: Callable[[StepMeter], None], device: torch.device, *,
          seconds: float, warmup: int = 2, waits: bool = False) -> Phase:
    """Warm up, learn how long ``one`` takes, then time enough calls to fill ``seconds``.

    ``one(meter)`` does one call and adds it to the meter; ``waits``: it counts data wait too.
    The first call pays the one-time costs (allocations, autotuning, workers starting); the
    warm-up calls after it also tell how long one call takes.
    """
    meter = StepMeter(device)
    one(meter)
    meter.read()  # waits for the device: the timing starts from an empty queue
    started, calls = time.perf_counter(), 0
    # Every rank calls as often (a step all-reduces under DDP): go on while any rank wants to.
    while any(group.any_rank(calls < max(1, warmup - 1) or time.perf_counter() - started
                                   < min(0.2 * seconds, 1.0))):
        one(meter)
        calls += 1
    meter.read()
    per_call = (time.perf_counter() - started) / calls
    # Every rank the same count: the slowest's.
    count = min(group.all_gather(max(2, round(seconds / per_call))))
    meter.restart()
    for _ in range(count):
        one(meter)
    scalars = meter.read()
    total = device_memory_gib(device)
    peak = scalars.get("memory/cuda_peak_allocated_gib", scalars["memory/cpu_rss_gib"])
    wait = scalars["time/data_wait_pct"] / 100 if waits else None
    return Phase(name, scalars["throughput/samples_per_s"], scalars["throughput/steps_per_s"],
                 wait, peak, peak / total, count / scalars["throughput/steps_per_s"], count)
