"""trainkit: a small, fast, dependable PyTorch training harness.

Use it whole (``Trainer(...).fit(...)``, or ``python -m trainkit.train +exp=mnist``) or piece by
piece: devices, data loaders, mixed precision, the step, EMA, checkpoints, preemption, logging.

Each name is imported when first used (PEP 562), so that commands that need no torch
(``trainkit --help``, ``trainkit runs``) start without importing it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and IDEs read; at run time: _SOURCES and __getattr__
    from trainkit.checkpoint.async_writer import AsyncCheckpointWriter
    from trainkit.checkpoint.files import (
        CheckpointFiles,
        CheckpointManager,
        load_checkpoint,
        save_atomic,
    )
    from trainkit.checkpoint.load import load_model
    from trainkit.config import CheckpointConfig, DataConfig, TrainConfig, TrainerConfig
    from trainkit.core.device import available_devices, move_to_device, resolve_device
    from trainkit.core.errors import ConfigError, TrainkitError
    from trainkit.core.rng import seed_everything
    from trainkit.core.runtime import Runtime
    from trainkit.core.signals import EXIT_PREEMPTED, Preemption
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
    from trainkit.data.sources.tensors import TensorData, load_cifar10, load_mnist
    from trainkit.distributed.fsdp import shard_model
    from trainkit.distributed.watchdog import EXIT_HUNG, Watchdog
    from trainkit.loop.activations import apply_activation_checkpointing
    from trainkit.loop.callbacks import Callback, EarlyStopping
    from trainkit.loop.context import EvalContext
    from trainkit.loop.ema import EMA
    from trainkit.loop.precision import Precision
    from trainkit.loop.preemptible import preemptible
    from trainkit.loop.select import Select
    from trainkit.loop.step import StepContext, StepResult, WindowStep, train_window, windows
    from trainkit.loop.trainer import NonFiniteLossError, Trainer, TrainState
    from trainkit.models.param_groups import param_groups
    from trainkit.models.pretrained import load_pretrained
    from trainkit.observe.trackers import MLflowSink, WandbSink

__version__ = "0.1.0"

__all__ = [
    "EMA",
    "EXIT_HUNG",
    "EXIT_PREEMPTED",
    "AsyncCheckpointWriter",
    "Callback",
    "CheckpointConfig",
    "CheckpointFiles",
    "CheckpointManager",
    "ConfigError",
    "DataConfig",
    "DevicePrefetcher",
    "EarlyStopping",
    "EvalContext",
    "InMemoryLoader",
    "MLflowSink",
    "NonFiniteLossError",
    "Precision",
    "Preemption",
    "ResumableData",
    "ResumableLoader",
    "Runtime",
    "Select",
    "StepContext",
    "StepResult",
    "TensorData",
    "TrainConfig",
    "TrainState",
    "Trainer",
    "TrainerConfig",
    "TrainkitError",
    "WandbSink",
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
    "load_model",
    "load_pretrained",
    "make_loader",
    "move_to_device",
    "param_groups",
    "preemptible",
    "resolve_device",
    "save_atomic",
    "seed_everything",
    "shard_model",
    "train_window",
    "windows",
]

# public name -> the module that defines it
_SOURCES = {name: module for module, names in (
    ("trainkit.checkpoint.async_writer", "AsyncCheckpointWriter"),
    ("trainkit.checkpoint.files", "CheckpointFiles CheckpointManager load_checkpoint save_atomic"),
    ("trainkit.checkpoint.load", "load_model"),
    ("trainkit.config", "CheckpointConfig DataConfig TrainConfig TrainerConfig"),
    ("trainkit.core.device", "available_devices move_to_device resolve_device"),
    ("trainkit.core.errors", "ConfigError TrainkitError"),
    ("trainkit.core.rng", "seed_everything"),
    ("trainkit.core.runtime", "Runtime"),
    ("trainkit.core.signals", "EXIT_PREEMPTED Preemption"),
    ("trainkit.data", "DevicePrefetcher InMemoryLoader ResumableData ResumableLoader build_loaders"
                      " crop_flip default_num_workers make_loader"),
    ("trainkit.data.sources.tensors", "TensorData load_cifar10 load_mnist"),
    ("trainkit.distributed.fsdp", "shard_model"),
    ("trainkit.distributed.watchdog", "EXIT_HUNG Watchdog"),
    ("trainkit.loop.activations", "apply_activation_checkpointing"),
    ("trainkit.loop.callbacks", "Callback EarlyStopping"),
    ("trainkit.loop.context", "EvalContext"),
    ("trainkit.loop.ema", "EMA"),
    ("trainkit.loop.precision", "Precision"),
    ("trainkit.loop.preemptible", "preemptible"),
    ("trainkit.loop.select", "Select"),
    ("trainkit.loop.step", "StepContext StepResult WindowStep train_window windows"),
    ("trainkit.loop.trainer", "NonFiniteLossError Trainer TrainState"),
    ("trainkit.models.param_groups", "param_groups"),
    ("trainkit.models.pretrained", "load_pretrained"),
    ("trainkit.observe.trackers", "MLflowSink WandbSink"),
) for name in names.split()}


def __getattr__(name: str) -> Any:
    if name not in _SOURCES:
        raise AttributeError(f"module 'trainkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(_SOURCES[name]), name)
    globals()[name] = value  # once: later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
