"""The entry point's side of the data: config nodes built, ``data.num_classes`` filled in.

``dataset._target_`` becomes the reader, ``data.train_transforms`` / ``data.eval_transforms``
lists of ``_target_`` nodes become callables (Hydra builds them: only entry points import it),
and once the data is read its class count goes into ``data.num_classes``, which the model and
metrics configs take by interpolation (``num_classes: ${data.num_classes}``): no number typed
twice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from trainkit.config import TrainConfig
from trainkit.core.errors import ConfigError
from trainkit.core.runtime import Runtime
from trainkit.data import build_loaders
from trainkit.data.classes import write_classes
from trainkit.entry.rebuild import data_inputs, write_inputs


def build_data(cfg: DictConfig, settings: TrainConfig, runtime: Runtime) -> tuple[Any, Any, int]:
    """The training and evaluation loaders ``cfg.data`` (and ``cfg.dataset``) describe; sets
    ``cfg.data.num_classes`` to the data's class count.

    Raises:
        ConfigError: ``data.num_classes`` was set to another count than the data has.
    """
    # Your own dataset (a `dataset._target_` node) replaces the built-in one named by data.name.
    reader = instantiate(cfg.dataset, _partial_=True) if cfg.get("dataset") is not None else None
    data = cfg.data
    train_data, val_data, num_classes = build_loaders(
        settings.data, runtime, seed=settings.trainer.seed,
        channels_last=settings.trainer.channels_last, reader=reader,
        train_transforms=build_transforms(data.get("train_transforms"), "data.train_transforms"),
        eval_transforms=build_transforms(data.get("eval_transforms"), "data.eval_transforms"),
        eval_max_batches=settings.trainer.eval_max_batches)  # a fixed, spread sample
    asked = settings.data.num_classes
    if asked is not None and asked != num_classes:
        raise ConfigError(f"data.num_classes={asked} but the data has {num_classes} classes: "
                          "leave data.num_classes unset (null), it is read from the data")
    with open_dict(cfg):
        cfg.data.num_classes = num_classes
    return train_data, val_data, num_classes


def build_transforms(nodes: Any, key: str) -> list[Any] | None:
    """The transform list config ``key`` gives (its ``_target_`` nodes built); None if unset."""
    if nodes is None:
        return None
    if not OmegaConf.is_list(nodes):
        raise ConfigError(f"{key} must be a list of _target_ nodes, got {nodes!r}")
    return [instantiate(node, _convert_="all") for node in nodes]


def save_classes(run_dir: str | Path, train_data: Any, runtime: Runtime) -> None:
    """``<run_dir>/classes.json`` when the loader knows its class names (rank 0 writes it)."""
    classes = getattr(train_data, "classes", None)
    if classes is not None and runtime.is_main:
        write_classes(run_dir, classes)


def save_inputs(run_dir: str | Path, cfg: DictConfig, settings: TrainConfig, train_data: Any,
                runtime: Runtime) -> None:
    """``<run_dir>/inputs.json``: what an image model takes (mean/std, image size, classes,
    evaluation transform), derived as export and predict would derive it from the data, so that
    they need neither the data nor the module of ``dataset._target_`` (rank 0 writes it)."""
    if runtime.is_main and settings.data.name not in ("tokens", "hf_text"):  # image models only
        write_inputs(run_dir, data_inputs(cfg, settings, getattr(train_data, "classes", None)))
