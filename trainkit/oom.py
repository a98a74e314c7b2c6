"""Out of memory: give the memory back, log what held it, and end with one line of advice."""

from __future__ import annotations

import gc
import logging
import traceback
from typing import Any

import torch

from trainkit.device import memory_stats
from trainkit.errors import one_line

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


def report(error: BaseException, device: torch.device, *, step: int, batch: Any,
           accumulate: int, precision: str) -> str:
    """Log the details (the error, the allocator's figures and summary); return the last line.

    The returned line says what ran out and what to change, in at most 200 characters.
    """
    details = [f"out of memory: {one_line(error, 400)}",
               f"batch {batch} x accumulate {accumulate}, precision {precision}"]
    if device.type == "cuda":
        stats = memory_stats(device)
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        details.append(f"peak allocated {stats['cuda_peak_allocated_gib']:.2f} GiB, reserved "
                       f"{stats['cuda_reserved_gib']:.2f} of {total:.1f} GiB")
    for line in details:
        log.error(line)
    if device.type == "cuda":  # what still holds memory after the step's tensors were dropped
        log.info("allocator summary for %s:\n%s", device, torch.cuda.memory_summary(device))
    return advice(device, step, batch)


def advice(device: torch.device, step: int, batch: Any) -> str:
    """The one line that ends a run that ran out of memory."""
    return (f"out of memory on {device} at step {step} with batch {batch}: halve data.batch_size "
            "and double trainer.accumulate_grad_batches, or use bf16-mixed or "
            "trainer.activation_checkpointing")
