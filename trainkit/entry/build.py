"""A run's parts built from its config, one function each, for every command.

``trainkit train`` and ``probe`` build a new run (:func:`build_parts`); ``evaluate``, ``predict``
and ``export`` rebuild a finished one from the config its checkpoint stores (:func:`rebuild`),
through the same :func:`build_run_model`, :func:`build_data` and metrics, so both see the same model
and batches. The config is never written to: the data's class count is passed to what needs it
(``${data.num_classes}`` resolved in a copy), and what the model takes is recorded once as the
run trains (``inputs.json``) for export and predict.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from trainkit.checkpoint import load
from trainkit.checkpoint.adapters import check_adapters_only
from trainkit.checkpoint.export import Inputs, read_inputs, write_inputs
from trainkit.checkpoint.select import checkpoint_name, find_checkpoint, model_weights, read_whole
from trainkit.config import TrainConfig
from trainkit.core.errors import ConfigError, TrainkitError
from trainkit.core.runtime import Runtime
from trainkit.core.schema import check_known_keys
from trainkit.data import (
    SOURCES,
    Data,
    TensorData,
    load_data,
    read_classes,
    source_of,
    stats_for,
    transform_for,
    write_classes,
)
from trainkit.data.mixing import MixedBatches, batch_mixing
from trainkit.loop.step import default_forward
from trainkit.models import muon, param_groups
from trainkit.models.build import ModelKeys, make_model
from trainkit.models.vision import for_channels

# data keys that say where the data is and how to read it, not what the model takes
LOCATION_KEYS = ("data.root", "data.skip_corrupt", "data.num_workers", "data.eval_batch_size")


def build_settings(cfg: DictConfig) -> TrainConfig:
    """The typed config, built once per command: unknown keys refused (a ``+key=value`` typo
    would be saved and ignored), types and ranges checked."""
    check_known_keys(cfg)
    if cfg.get("model") is not None:
        ModelKeys.split(cfg.model)  # model.pretrained and model.lora: their types checked
    return OmegaConf.to_object(cfg)


class RunParts(NamedTuple):
    """What a config builds for a run besides the Trainer (:func:`build_parts`)."""

    train_data: Any
    val_data: Any
    num_classes: int
    model: Any
    optimizer: Any
    criterion: Any
    forward: Any


def build_parts(cfg: DictConfig, settings: TrainConfig, runtime: Runtime) -> RunParts:
    """Data, model, optimizer, criterion and forward of a new run, in that order (seed first:
    the model's initial weights). ``train`` and ``probe`` both build a run this way."""
    train_data, val_data, num_classes = build_data(cfg, settings, runtime)
    mix = batch_mixing(num_classes, mixup=settings.data.mixup, cutmix=settings.data.cutmix)
    if mix is not None:  # data.mixup / data.cutmix: training batches only
        train_data = MixedBatches(train_data, mix, seed=settings.trainer.seed, rank=runtime.rank)
    model = build_run_model(cfg, num_classes, channels=settings.data.channels, pretrained=True)
    if settings.checkpoint.adapters_only:  # refused now, not once the run has begun
        check_adapters_only(model, sharded=settings.trainer.strategy == "fsdp")
    vocab = getattr(model, "vocab_size", None)
    if isinstance(vocab, int) and isinstance(num_classes, int) and vocab < num_classes:
        raise ConfigError(f"model.vocab_size={vocab} but the data's tokens go up to "
                          f"{num_classes}: set model.vocab_size={num_classes}")
    return RunParts(train_data, val_data, num_classes, model, build_optimizer(cfg, model),
                    build_criterion(cfg), build_forward(cfg))


def build_data(cfg: DictConfig, settings: TrainConfig, runtime: Runtime) -> Data:
    """The training and evaluation loaders and the data's class count (which the model and
    metrics take as ``${data.num_classes}``), from :func:`trainkit.data.load_data`; your own
    dataset (a ``dataset._target_`` node) replaces the built-in one named by ``data.name``."""
    reader = instantiate(cfg.dataset, _partial_=True) if cfg.get("dataset") is not None else None
    return load_data(
        settings.data, runtime, seed=settings.trainer.seed,
        channels_last=settings.trainer.channels_last, reader=reader,
        train_transforms=build_transforms(cfg.data.get("train_transforms"),
                                          "data.train_transforms"),
        eval_transforms=build_transforms(cfg.data.get("eval_transforms"), "data.eval_transforms"),
        eval_max_batches=settings.trainer.eval_max_batches)  # a fixed, spread sample


def build_transforms(nodes: Any, key: str) -> list[Any] | None:
    """The transform list config ``key`` gives (its ``_target_`` nodes built); None if unset."""
    if nodes is None:
        return None
    if not OmegaConf.is_list(nodes):
        raise ConfigError(f"{key} must be a list of _target_ nodes, got {nodes!r}")
    return [instantiate(node, _convert_="all") for node in nodes]


def build_run_model(cfg: DictConfig, num_classes: int | None, *, channels: int,
                weights: Mapping[str, torch.Tensor] | None = None, source: Any = "?",
                adapters_only: bool = False, pretrained: bool = False) -> nn.Module:
    """The run's ``model`` node built with ``${data.num_classes}`` = ``num_classes``, its stem
    for ``channels``: a new run's (``weights`` None) with ``model.lora`` applied and, with
    ``pretrained`` (training's model; as :func:`~trainkit.models.build.make_model`, off by
    default), ``model.pretrained``'s weights loaded; or a finished run's holding ``weights``
    (from ``source``; checked to fit)."""
    node = model_node(cfg, num_classes, channels)
    if weights is None:
        return make_model(node, pretrained=pretrained)
    return load.build_model(OmegaConf.to_container(node, resolve=True), weights, path=source,
                            adapters_only=adapters_only)


def model_node(cfg: DictConfig, num_classes: int | None, channels: int) -> DictConfig:
    """``cfg.model`` as the run builds it (:func:`_as_built`)."""
    return _as_built(cfg, num_classes, channels).model


def run_record(cfg: DictConfig, num_classes: int | None, channels: int) -> dict[str, Any]:
    """The resolved config a run's checkpoints store, which :func:`rebuild` reads back: the
    class count filled in and the model node as built."""
    return OmegaConf.to_container(_as_built(cfg, num_classes, channels), resolve=True)


def _as_built(cfg: DictConfig, num_classes: int | None, channels: int | None = None
              ) -> DictConfig:
    """A copy of ``cfg`` (which stays as given) whose ``data.num_classes`` is the data's, so
    ``${data.num_classes}`` resolves, and with ``channels`` a torchvision classifier's stem
    made for them (grayscale data: :func:`~trainkit.models.vision.for_channels`)."""
    built = copy.deepcopy(cfg)
    with open_dict(built):
        built.data.num_classes = num_classes
        if channels is not None and built.get("model") is not None:
            built.model = for_channels(built.model, channels)
    return built


def build_optimizer(cfg: DictConfig, model: nn.Module) -> Any:
    """``cfg.optim`` on ``model``'s parameter groups (``optim.param_groups``, ``layer_decay``,
    ``decay_norm_and_bias``); the node's other keys go to its ``_target_``.

    Raises:
        ConfigError: ``optim=muon`` under ``trainer.strategy=fsdp``.
    """
    if "adamw_params" in cfg.optim and cfg.trainer.get("strategy") == "fsdp":
        raise ConfigError(muon.FSDP_REFUSAL)
    return param_groups.build_optimizer(
        model, OmegaConf.to_container(cfg.optim, resolve=True),
        lambda node, groups: instantiate(node, params=groups, _convert_="all"))


def build_criterion(cfg: DictConfig) -> Any:
    """The run's loss: its ``loss`` node (e.g. label smoothing), else plain cross-entropy."""
    return instantiate(cfg.loss) if cfg.get("loss") is not None else F.cross_entropy


def build_forward(cfg: DictConfig) -> Any:
    """The run's forward: its ``forward`` node (a language model's ``lm_forward``), else
    ``model(inputs), labels``."""
    return instantiate(cfg.forward) if cfg.get("forward") is not None else default_forward


def build_scheduler(cfg: DictConfig, optimizer: Any, total_steps: int) -> Any:
    """The ``sched`` node on ``optimizer`` for a run of ``total_steps``; None without one."""
    if cfg.get("sched") is None:
        return None
    return instantiate(cfg.sched, optimizer=optimizer, total_steps=total_steps)


def build_sinks(cfg: DictConfig) -> list[Any]:
    """Your ``sinks`` (trackers): built, not started -- they start, and import their libraries,
    with training, on rank 0 (docs/trackers.md); a null node is left out."""
    return [instantiate(node, _convert_="all") for node in (cfg.get("sinks") or {}).values()
            if node is not None]


def build_callbacks(cfg: DictConfig, model: nn.Module) -> list[Any]:
    """Your ``callbacks`` (name -> ``_target_``; null drops one), on every rank; one that
    samples from the model (``set_model``: PrintSample) is given it."""
    callbacks = [instantiate(node, _convert_="all")
                 for node in (cfg.get("callbacks") or {}).values() if node is not None]
    for callback in callbacks:
        if hasattr(callback, "set_model"):
            callback.set_model(model)
    return callbacks


def build_metrics(cfg: DictConfig, num_classes: int) -> dict[str, Any]:
    """The run's ``metrics`` node built with ``${data.num_classes}`` = ``num_classes``, each
    checked against it (another dataset's count fails late, obscurely); ``name: null`` drops
    one."""
    nodes = _as_built(cfg, num_classes).get("metrics") or {}
    metrics = {name: instantiate(node) for name, node in nodes.items() if node is not None}
    for name, metric in metrics.items():
        classes = getattr(metric, "num_classes", None)
        if isinstance(classes, int) and classes != num_classes:
            raise ConfigError(f"metrics.{name}.num_classes={classes} but the data has "
                              f"{num_classes} classes: set metrics.{name}.num_classes="
                              f"{num_classes}")
    return metrics


def save_run_files(run_dir: str | Path, cfg: DictConfig, settings: TrainConfig,
                   parts: RunParts, runtime: Runtime) -> None:
    """``classes.json`` (the loader's class names) and, for an image model, ``inputs.json``
    (what it takes), written by rank 0 once the config has passed every check: a run stopped
    by bad input leaves no folder."""
    if not runtime.is_main:
        return
    classes = getattr(parts.train_data, "classes", None)
    if classes is not None:
        write_classes(run_dir, classes)
    source = source_of(settings.data.name, own_reader=cfg.get("dataset") is not None)
    if source.takes == "images":  # image models only
        write_inputs(run_dir, data_inputs(cfg, settings, classes, parts.num_classes))


@dataclass
class Rebuilt:
    """A finished run's checkpoint, config and model (on the CPU, eval mode, chosen weights)."""

    run_dir: Path
    name: str  # the ckpt as the user named it: best, last, step_N, or the file's stem
    state: dict[str, Any]
    cfg: DictConfig
    settings: TrainConfig
    model: nn.Module
    weights: str  # "ema" or "raw"
    # the command line set a data.* key that may change the inputs (it wins over the record)
    data_overridden: bool = False

    @property
    def step(self) -> int:
        return int(self.state["global_step"])


def rebuild(run_dir: Path, ckpt: str, weights: str, overrides: Sequence[str]) -> Rebuilt:
    """The run's checkpoint ``ckpt`` (``""``: ``best`` where kept, else ``last``) with its model
    built from the config it stores, changed by ``overrides`` and checked as training checks."""
    path = find_checkpoint(run_dir, ckpt or None)
    state = read_whole(path)
    saved = state.get("config")
    if not saved:
        raise TrainkitError(f"checkpoint {path} holds no config (not written by the trainkit "
                            "entry point): use trainkit.load_model's building blocks by hand")
    saved = {k: v for k, v in saved.items() if k not in ("sinks", "callbacks")}  # not rebuilt
    cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), saved,
                          OmegaConf.from_dotlist(list(overrides)))
    settings = build_settings(cfg)
    chosen, which = model_weights(state, weights)
    model = build_run_model(cfg, settings.data.num_classes, channels=settings.data.channels,
                        weights=chosen, source=path,
                        adapters_only=settings.checkpoint.adapters_only and which == "raw")
    name = checkpoint_name(path, ckpt)  # step_000000008 -> step_8, as ckpt= says
    data_overridden = any(o.lstrip("+~").startswith("data.") and o.lstrip("+~").split("=")[0]
                          not in LOCATION_KEYS for o in overrides)
    return Rebuilt(Path(run_dir), name, state, cfg, settings, model.eval(), which,
                   data_overridden)


def on_device(model: nn.Module, settings: TrainConfig, device: torch.device) -> nn.Module:
    """``model`` on ``device`` in the memory layout training evaluated it in (channels_last
    weights give other sums than contiguous ones: the recorded values need the same)."""
    model = model.to(device)
    if settings.trainer.channels_last and settings.trainer.strategy != "fsdp":
        model = model.to(memory_format=torch.channels_last)  # as Trainer.prepare_model does
    return model


def run_classes(run: Rebuilt) -> list[str] | None:
    """The run's class names: its checkpoint's, else its ``classes.json``; None if neither."""
    return read_classes(run.state) or read_classes(run.run_dir)


def model_inputs(run: Rebuilt) -> Inputs:
    """What the run's model takes as its training recorded it (``inputs.json``); derived from
    its data and config (:func:`data_inputs`) for a run from before that record, or where
    ``data.*`` keys on the command line may change it (an override is never ignored)."""
    recorded = None if run.data_overridden else read_inputs(run.run_dir)
    return recorded or data_inputs(run.cfg, run.settings, run_classes(run),
                                   run.settings.data.num_classes)


def data_inputs(cfg: DictConfig, settings: TrainConfig, classes: Sequence[str] | None,
                num_classes: int | None = None) -> Inputs:
    """What a run's image model takes: tensor data's (MNIST, CIFAR-10, a ``TensorData`` of
    yours) from its evaluation split, read here; decoded images' (an image folder, shards,
    your own ``Dataset``) from the config (:func:`decoded_inputs`)."""
    source = None if cfg.get("dataset") is not None else source_of(settings.data.name)
    if source is None or source.read_split is not None or source.takes != "images":
        split = read_split(cfg, settings, train=False)  # tensor data's own (tokens: refused)
        if isinstance(split, TensorData):
            return inputs_of(split)
    return decoded_inputs(cfg, settings, classes, num_classes)


def decoded_inputs(cfg: DictConfig, settings: TrainConfig, classes: Sequence[str] | None,
                   num_classes: int | None = None) -> Inputs:
    """What a model trained on decoded images takes, from its config alone: ``data.mean`` /
    ``std``, channels, image size, evaluation transform, and ``classes`` (else ``0..N-1``)."""
    data = settings.data
    nodes = cfg.data.get("eval_transforms")
    described = ({"eval_transforms": OmegaConf.to_container(nodes, resolve=True)} if nodes
                 else {"resize_short_side": int(data.image_size / data.crop_pct),
                       "center_crop": data.image_size})
    mean, std = stats_for(data)
    names = list(classes or [str(i) for i in range(num_classes or data.num_classes or 0)])
    return Inputs(mean, std, (data.channels, data.image_size, data.image_size), names,
                  fused=True, transform=described)


def inputs_of(split: TensorData) -> Inputs:
    """What the model takes, from a split of its tensor data: mean/std, image size, classes."""
    classes = getattr(split, "classes", None) or [str(i) for i in range(split.num_classes)]
    return Inputs(tuple(split.mean), tuple(split.std), tuple(split.images.shape[1:]),
                  list(classes))


def read_split(cfg: DictConfig, settings: TrainConfig, *, train: bool) -> Any:
    """One split of the run's dataset, whole, as the loaders read it: a ``TensorData``, or the
    map-style ``Dataset`` that the run's ``dataset._target_`` returns."""
    data = settings.data
    if cfg.get("dataset") is not None:
        return instantiate(cfg.dataset, _partial_=True)(root=data.root, train=train)
    source = source_of(data.name)
    if source.takes == "tokens":  # predict's and export's inputs are images
        raise TrainkitError("this run trained a language model on tokens: predict and export "
                            "take image models; `trainkit evaluate` evaluates it, and its "
                            "weights load with trainkit.load_checkpoint")
    if source.read_split is None:
        whole = [name for name, s in SOURCES.items() if s.read_split is not None]
        raise TrainkitError(f"data.name={data.name!r}: only the built-in datasets "
                            f"({', '.join(whole)}) have test and train splits here; give a "
                            "folder of images instead")
    return source.read_split(data, train=train)


def run_eval_transform(run: Rebuilt) -> tuple[Inputs, Any, bool]:
    """For a run that decoded images: what its model takes, the transform its evaluation gave a
    decoded uint8 image, and whether that is the run's own ``data.eval_transforms``."""
    custom = build_transforms(run.cfg.data.get("eval_transforms"), "data.eval_transforms")
    transform = transform_for(run.settings.data, training=False, custom=custom)
    inputs = decoded_inputs(run.cfg, run.settings, run_classes(run),
                            run.settings.data.num_classes)
    return inputs, transform, custom is not None
