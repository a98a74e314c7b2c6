"""A finished run rebuilt for ``trainkit evaluate``, ``predict`` and ``export``: its checkpoint,
its own config (with the command's overrides), its model with the chosen weights, its data.

The run's config is the one its checkpoint stores (resolved, as it trained), checked by the
same schema as training; the data and metrics are built by the functions training builds them
with (:func:`trainkit.train.build_data`), so an evaluation sees the same batches.
What an image model takes (mean/std, image size, classes, evaluation transform) is derived here
(:func:`data_inputs`), once when the run trains, into ``<run>/inputs.json``: export and predict
over files read it there, without the data.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from trainkit.checkpoint.export import Inputs
from trainkit.checkpoint.load import build_model
from trainkit.checkpoint.select import find_checkpoint, model_weights, read_checkpoint
from trainkit.config import TrainConfig
from trainkit.core.errors import ConfigError, TrainkitError, command_name, help_text, one_line
from trainkit.data.sources.tensors import READERS, TensorData
from trainkit.loop.step import default_forward

INPUTS_FILE = "inputs.json"  # what the model takes, recorded when the run trains
# data keys that say where the data is and how to read it, not what the model takes
LOCATION_KEYS = ("data.root", "data.skip_corrupt", "data.num_workers", "data.eval_batch_size")


@dataclass
class Rebuilt:
    """A run's checkpoint, config and model (on the CPU, eval mode, the chosen weights)."""

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


def usage_status(args: Sequence[str], module: str, usage: str, doc: str | None) -> int | None:
    """Print a command's usage when ``args`` is empty (to stderr: exit status 2) or asks for help
    (to stdout: 0); None when the command should run."""
    if args and args[0] not in ("-h", "--help"):
        return None
    print(f"usage: {command_name(module)} {usage}\n\n{help_text(doc)}",
          file=sys.stdout if args else sys.stderr)
    return 0 if args else 2


def split_args(args: Sequence[str], options: dict[str, str], usage: str
               ) -> tuple[Path, dict[str, str], list[str]]:
    """``RUN_DIR key=value ...`` as the run folder, the command's own options (``options``:
    their defaults) and the config overrides (every other ``key=value``)."""
    positional = [a for a in args if "=" not in a]
    if len(positional) != 1:
        raise TrainkitError(f"give one run folder, then key=value settings: {usage}")
    chosen, overrides = dict(options), []
    for arg in args:
        if "=" in arg:
            key, value = arg.split("=", 1)
            if key in options:
                chosen[key] = value
            else:
                overrides.append(arg.removeprefix("+"))
    return Path(positional[0]), chosen, overrides


def rebuild(run_dir: Path, ckpt: str, weights: str, overrides: Sequence[str]) -> Rebuilt:
    """The run's checkpoint ``ckpt`` with its model built from the run's config; ``ckpt=""``:
    ``best`` where the run kept one, else ``last``."""
    path = find_checkpoint(run_dir, ckpt or None)
    state = read_checkpoint(path)
    saved = state.get("config")
    if not saved:
        raise TrainkitError(f"checkpoint {path} holds no config (not written by the trainkit "
                            "entry point): use trainkit.load_model's building blocks by hand")
    saved = {k: v for k, v in saved.items() if k not in ("sinks", "callbacks")}  # not rebuilt
    cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), saved,
                          OmegaConf.from_dotlist(list(overrides)))
    settings: TrainConfig = OmegaConf.to_object(cfg)
    chosen, which = model_weights(state, weights)
    model = build_model(OmegaConf.to_container(cfg.model, resolve=True), chosen, path=path,
                        adapters_only=settings.checkpoint.adapters_only and which == "raw")
    name = path.name.removesuffix(".pt") if not ckpt or path == Path(ckpt) else ckpt
    name = re.sub(r"^step_0+(?=\d)", "step_", name)  # step_000000008 -> step_8, as ckpt= says
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


def read_split(cfg: DictConfig, settings: TrainConfig, *, train: bool) -> Any:
    """One split of the run's dataset, whole, as the loaders read it: a ``TensorData``, or the
    map-style ``Dataset`` that the run's ``dataset._target_`` returns."""
    from hydra.utils import instantiate

    data = settings.data
    if cfg.get("dataset") is not None:
        return instantiate(cfg.dataset, _partial_=True)(root=data.root, train=train)
    if data.name == "tokens":  # predict's and export's inputs are images
        raise TrainkitError("this run trained a language model on tokens: predict and export "
                            "take image models; `trainkit evaluate` evaluates it, and its "
                            "weights load with trainkit.load_checkpoint")
    if data.name not in READERS:
        raise TrainkitError(f"data.name={data.name!r}: only the built-in datasets "
                            f"({', '.join(READERS)}) have test and train splits here; give a "
                            "folder of images instead")
    return READERS[data.name](data.root, train=train, verify=data.verify, download=data.download)


def inputs_of(split: TensorData) -> Inputs:
    """What the model takes, from a split of its data: mean/std, image size, class names."""
    classes = getattr(split, "classes", None) or [str(i) for i in range(split.num_classes)]
    return Inputs(tuple(split.mean), tuple(split.std), tuple(split.images.shape[1:]),
                  list(classes))


def build_metrics(cfg: DictConfig, num_classes: int) -> dict[str, Any]:
    """The run's ``metrics`` node built, each checked against the data's class count."""
    from hydra.utils import instantiate

    metrics = {name: instantiate(node) for name, node in (cfg.get("metrics") or {}).items()
               if node is not None}  # an experiment drops one with `name: null`
    for name, metric in metrics.items():  # a class count of another dataset fails late, obscurely
        classes = getattr(metric, "num_classes", None)
        if isinstance(classes, int) and classes != num_classes:
            raise ConfigError(f"metrics.{name}.num_classes={classes} but the data has "
                              f"{num_classes} classes: set metrics.{name}.num_classes="
                              f"{num_classes}")
    return metrics


def build_criterion(cfg: DictConfig) -> Any:
    """The run's loss: its ``loss`` node (e.g. label smoothing), else plain cross-entropy."""
    from hydra.utils import instantiate

    return instantiate(cfg.loss) if cfg.get("loss") is not None else F.cross_entropy


def build_forward(cfg: DictConfig) -> Any:
    """The run's forward: its ``forward`` node (a language model's ``lm_forward``), else
    ``model(inputs), labels``."""
    from hydra.utils import instantiate

    return instantiate(cfg.forward) if cfg.get("forward") is not None else default_forward


def image_source(run: Rebuilt) -> tuple[Inputs, Callable[[Path], torch.Tensor]]:
    """What the model takes (:func:`model_inputs`), and a reader of an image file into it (uint8
    ``[C, H, W]``): for a run on tensor data the file in that data's mode and size; for a run
    that decoded images the run's own evaluation transform (:mod:`trainkit.data.transforms`)."""
    inputs = model_inputs(run)
    if not inputs.fused:  # tensor data: normalised as its in-memory loaders do
        return inputs, lambda path: read_image(path, inputs.image_size)
    from trainkit.data.transforms import load_image

    _, transform, _ = eval_transform(run)
    channels = run.settings.data.channels
    return inputs, lambda path: transform(load_image(path, channels=channels))


def model_inputs(run: Rebuilt) -> Inputs:
    """What the run's model takes, as its training recorded it (``<run>/inputs.json``), so that
    export and predict need neither its data nor its ``dataset._target_``'s module; a run from
    before that record, or ``data.*`` keys given on the command line: derived from its data
    and config (:func:`data_inputs`), so an override is never silently ignored."""
    recorded = None if run.data_overridden else read_inputs(run.run_dir)
    return recorded or data_inputs(run.cfg, run.settings, run_classes(run))


def data_inputs(cfg: DictConfig, settings: TrainConfig, classes: Sequence[str] | None) -> Inputs:
    """What a run's image model takes: for a run on tensor data (MNIST, CIFAR-10, a
    ``TensorData`` of yours) the mean/std, image size and classes of its evaluation split (read
    here); for a run that decoded images (an image folder, shards, your own ``Dataset``) its
    config's mean/std, size and evaluation transform, with ``classes`` (its loader's names)."""
    data = settings.data
    if cfg.get("dataset") is not None or data.name not in ("image_folder", "webdataset"):
        split = read_split(cfg, settings, train=False)
        if isinstance(split, TensorData):
            return inputs_of(split)
    return decoded_inputs(cfg, settings, classes)


def decoded_inputs(cfg: DictConfig, settings: TrainConfig, classes: Sequence[str] | None
                   ) -> Inputs:
    """What a model trained on decoded images takes, from its config alone: ``data.mean`` /
    ``std``, channels, image size, evaluation transform, and ``classes`` (else ``0..N-1``)."""
    from trainkit.data.transforms import stats_for

    data = settings.data
    nodes = cfg.data.get("eval_transforms")
    described = ({"eval_transforms": OmegaConf.to_container(nodes, resolve=True)} if nodes
                 else {"resize_short_side": int(data.image_size / data.crop_pct),
                       "center_crop": data.image_size})
    mean, std = stats_for(data)
    names = list(classes or [str(i) for i in range(cfg.data.get("num_classes") or 0)])
    return Inputs(mean, std, (data.channels, data.image_size, data.image_size), names,
                  fused=True, transform=described)


def write_inputs(run_dir: str | Path, inputs: Inputs) -> Path:
    """``inputs`` as ``<run_dir>/inputs.json`` (written whole: beside it, then renamed)."""
    path = Path(run_dir) / INPUTS_FILE
    partial = path.with_name(f".{INPUTS_FILE}.{os.getpid()}")
    partial.write_text(json.dumps(asdict(inputs), indent=1) + "\n")
    os.replace(partial, path)
    return path


def read_inputs(run_dir: str | Path) -> Inputs | None:
    """The :class:`Inputs` a run's training recorded; None for a run from before the record."""
    path = Path(run_dir) / INPUTS_FILE
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    return Inputs(tuple(saved["mean"]), tuple(saved["std"]), tuple(saved["image_size"]),
                  list(saved["classes"]), fused=saved["fused"], transform=saved["transform"])


def run_classes(run: Rebuilt) -> list[str] | None:
    """The run's class names: its checkpoint's, else its ``classes.json``; None if neither."""
    from trainkit.data.classes import read_classes

    return read_classes(run.state) or read_classes(run.run_dir)


def eval_transform(run: Rebuilt) -> tuple[Inputs, Callable[[torch.Tensor], torch.Tensor], bool]:
    """For a run that decoded images: what its model takes, the transform its evaluation gave a
    decoded uint8 image, and whether that is the run's own ``data.eval_transforms``."""
    from trainkit.data.transforms import transform_for
    from trainkit.entry.train import build_transforms

    custom = build_transforms(run.cfg.data.get("eval_transforms"), "data.eval_transforms")
    transform = transform_for(run.settings.data, training=False, custom=custom)
    inputs = decoded_inputs(run.cfg, run.settings, run_classes(run))
    return inputs, transform, custom is not None


def read_image(path: Path, size: Sequence[int]) -> torch.Tensor:
    """``path`` as uint8 ``[C, H, W]`` in a tensor dataset's mode (gray or RGB) and size."""
    from PIL import Image, UnidentifiedImageError
    from torchvision.transforms.v2 import functional

    from trainkit.data.transforms import UnreadableImage

    try:
        with Image.open(path) as file:
            image = functional.pil_to_tensor(file.convert("L" if size[0] == 1 else "RGB"))
    except (UnidentifiedImageError, OSError) as err:
        why = ("not an image format Pillow reads" if isinstance(err, UnidentifiedImageError)
               else one_line(err, 60))  # the path last: a shortened line keeps its end
        raise UnreadableImage(f"cannot read an image file ({why}); replace or delete it, or "
                              f"set data.skip_corrupt=true to skip such files: {path}") from None
    if tuple(image.shape[-2:]) != tuple(size[-2:]):
        image = functional.resize(image, list(size[-2:]), antialias=True)
    return image
