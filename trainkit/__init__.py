"""trainkit: a small, fast, dependable PyTorch training harness.

Use it whole (``Trainer(...).fit(...)``, or ``python -m trainkit.train +exp=mnist``) or piece by
piece: devices, data loaders, mixed precision, the step, EMA, checkpoints, preemption, logging.
"""

import gc as _gc

# Importing torch (first, through the imports below) makes ~200 k long-lived objects, and the
# allocations trigger full collections that walk all of them: three during `import trainkit`,
# 0.3-0.8 s of a 2-core machine's time, freeing nothing (modules, classes and functions are not
# garbage). The collector is paused for the imports only and its state restored after.
_collecting = _gc.isenabled()
_gc.disable()
try:
    from trainkit.checkpoint.async_writer import AsyncCheckpointWriter
    from trainkit.checkpoint.files import CheckpointManager, load_checkpoint, save_atomic
    from trainkit.config import CheckpointConfig, DataConfig, TrainConfig, TrainerConfig
    from trainkit.data import (
        DevicePrefetcher,
        InMemoryLoader,
        ResumableData,
        ResumableLoader,
        build_loaders,
        crop_flip,
        default_num_workers,
        make_loader,
    )
    from trainkit.data.datasets import TensorData, load_cifar10, load_mnist
    from trainkit.device import available_devices, move_to_device, resolve_device
    from trainkit.distributed.fsdp import shard_model
    from trainkit.distributed.watchdog import EXIT_HUNG, Watchdog
    from trainkit.errors import ConfigError, TrainkitError
    from trainkit.loop.activations import apply_activation_checkpointing
    from trainkit.loop.ema import EMA
    from trainkit.loop.precision import Precision
    from trainkit.loop.step import StepResult, WindowStep, train_window, windows
    from trainkit.loop.trainer import NonFiniteLossError, Trainer, TrainState
    from trainkit.rng import seed_everything
    from trainkit.runtime import Runtime
    from trainkit.signals import EXIT_PREEMPTED, Preemption
finally:
    if _collecting:
        _gc.enable()

__version__ = "0.1.0"

__all__ = [
    "EMA",
    "EXIT_HUNG",
    "EXIT_PREEMPTED",
    "AsyncCheckpointWriter",
    "CheckpointConfig",
    "CheckpointManager",
    "ConfigError",
    "DataConfig",
    "DevicePrefetcher",
    "InMemoryLoader",
    "NonFiniteLossError",
    "Precision",
    "Preemption",
    "ResumableData",
    "ResumableLoader",
    "Runtime",
    "StepResult",
    "TensorData",
    "TrainConfig",
    "TrainState",
    "Trainer",
    "TrainerConfig",
    "TrainkitError",
    "Watchdog",
    "WindowStep",
    "apply_activation_checkpointing",
    "available_devices",
    "build_loaders",
    "crop_flip",
    "default_num_workers",
    "load_checkpoint",
    "load_cifar10",
    "load_mnist",
    "make_loader",
    "move_to_device",
    "resolve_device",
    "save_atomic",
    "seed_everything",
    "shard_model",
    "train_window",
    "windows",
]
