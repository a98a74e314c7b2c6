"""Process-wide CUDA settings for a run: the current device, cuDNN autotuning, TF32, determinism.

torch keeps these as process globals, so they are set once per run, here, and said in the run's
first log line. On other devices nothing is touched.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from trainkit.core.cpu_settings import keep_freed_memory

# cuBLAS picks a fixed reduction order only with one of these workspace settings; it is read when
# the first cuBLAS handle is made, so it must be in the environment before CUDA is first used.
CUBLAS_WORKSPACE_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DETERMINISTIC = ":4096:8"


def apply_cuda_settings(device: torch.device, *, cudnn_benchmark: bool, tf32: bool) -> str:
    """Make ``device`` current and set cuDNN autotuning and TF32; return them as log text.

    The current device is where torch puts what names no device (``torch.cuda.synchronize()``,
    new streams and events, NCCL's communicator): ``cuda:1`` in one process must not leave it
    on ``cuda:0``. Returns ``""`` off CUDA, where nothing is changed.

    Example:
        >>> apply_cuda_settings(torch.device("cpu"), cudnn_benchmark=True, tf32=True)
        ''
    """
    if device.type != "cuda":
        return ""
    use_device(device)
    benchmark = set_backend_flags(cudnn_benchmark=cudnn_benchmark, tf32=tf32)
    why = " (deterministic algorithms are on)" if cudnn_benchmark and not benchmark else ""
    return (f"cuDNN benchmark {'on' if benchmark else 'off'}{why}, "
            f"TF32 {'on' if tf32 else 'off'}")


def use_device(device: torch.device) -> None:
    """Make a CUDA ``device`` the current one; nothing for other devices.

    Call it before anything touches CUDA: what follows the current device (pinned host memory,
    the DataLoader's pinning thread, streams and events made without a device) then lands on
    the run's GPU, and no context is made on ``cuda:0`` for a run on ``cuda:1``.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)


def set_backend_flags(*, cudnn_benchmark: bool, tf32: bool) -> bool:
    """Set cuDNN autotuning and TF32 for float32 matmuls and convolutions; return the benchmark
    flag as set.

    Autotuning stays off under deterministic algorithms (each process might pick another
    algorithm, with other rounding). TF32 goes through the legacy setters, which update the
    per-backend ``fp32_precision`` too: writing that one makes reading the legacy value raise, and
    Inductor still reads it (pytorch#166387).
    """
    benchmark = cudnn_benchmark and not torch.are_deterministic_algorithms_enabled()
    torch.backends.cudnn.benchmark = benchmark
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = tf32  # convolutions (torch's default: True)
    return benchmark


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """Deterministic kernels for the block, as they were after it.

    cuDNN deterministic with autotuning off, ``torch.use_deterministic_algorithms`` (warn-only:
    an operation with no deterministic kernel warns, naming itself, instead of failing the
    run) and cuBLAS's fixed workspace. Enter it before CUDA is first used in the process: the
    cuBLAS variable is read once.
    """
    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             os.environ.get(CUBLAS_WORKSPACE_ENV))
    os.environ.setdefault(CUBLAS_WORKSPACE_ENV, CUBLAS_DETERMINISTIC)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        enabled, warn_only, cudnn_deterministic, benchmark, workspace = saved
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.backends.cudnn.deterministic = cudnn_deterministic
        torch.backends.cudnn.benchmark = benchmark
        if workspace is None:
            os.environ.pop(CUBLAS_WORKSPACE_ENV, None)


def apply_device_settings(config: Any, device: torch.device) -> str:
    """The process-wide settings a :class:`~trainkit.config.TrainerConfig` asks for on ``device``
    (CPU: glibc keeps freed memory; CUDA: cuDNN autotuning, TF32), as log text ("" if none)."""
    if device.type == "cpu" and config.cpu_keep_freed_memory:
        return keep_freed_memory()
    return apply_cuda_settings(device, cudnn_benchmark=config.cudnn_benchmark, tf32=config.tf32)
