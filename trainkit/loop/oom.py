"""Out of memory: give the memory back, log what held it, and end with one line of advice."""

from __future__ import annotations

import gc
import logging
import traceback
from typing import Any

import torch

from trainkit.core.device import GIB, memory_stats
from trainkit.core.errors import one_line
from trainkit.observe.metrics import StepMeter

log = logging.getLogger("trainkit")


def release(error: BaseException, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Drop what the failed step still references, then return the cached blocks to the driver.

    The traceback's frames hold the step's activations and the batch; the gradients hang on the
    parameters. Emptying the cache before they are gone would free nothing.
    """
    traceback.clear_frames(error.__traceback__)
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    gc.collect()  # reference cycles through the cleared frames
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class Peaks:
    """The run's peak memory read now, for the summary of a run that ran out of memory before
    its meter existed (a new :class:`StepMeter` resets torch's peak: it must not be made after).
    """

    def __init__(self, device: torch.device) -> None:
        self._peaks = StepMeter.peaks_of(device)

    def peaks(self) -> dict[str, float]:
        return self._peaks


def report(error: BaseException, device: torch.device, *, step: int, batch: Any,
           accumulate: int, precision: str) -> tuple[str, list[str]]:
    """The last line (what ran out, what to change; <= 200 characters) and the detail lines.

    Call it before :func:`release`: the figures (reserved memory, the peak) and the allocator's
    summary (to the log, at length) are of the memory as it ran out, not of an emptied cache.
    The details are the error, the figures and what the advice keeps.
    """
    figures = f"precision {precision}, batch {batch} x accumulate {accumulate}"
    if device.type == "cuda":
        stats = memory_stats(device)
        total = torch.cuda.get_device_properties(device).total_memory / GIB
        figures += (f"; peak allocated {stats['cuda_peak_allocated_gib']:.2f} GiB, reserved "
                    f"{stats['cuda_reserved_gib']:.2f} of {total:.1f} GiB")
        log.info("allocator summary for %s:\n%s", device, torch.cuda.memory_summary(device))
    details = [figures, f"out of memory: {one_line(error, 400)}",
               "halving the batch and doubling the accumulation keeps the global batch; "
               "trainer.activation_checkpointing saves memory too",
               "checkpoints are untouched: re-run the same command to resume"]
    return advice(device, step, batch), details


def advice(device: torch.device, step: int, batch: Any) -> str:
    """The one line that ends a run that ran out of memory."""
    return (f"out of memory on {device} at step {step} with batch {batch}: halve data.batch_size "
            "and double trainer.accumulate_grad_batches, or use bf16-mixed or "
            "trainer.activation_checkpointing")
