"""A run's model weights for someone who does not use trainkit: a folder of one weights file
and ``model.json``.

``safetensors`` / ``pt`` hold the model's ``state_dict``, for a user with the model's class
(``hydra.utils.instantiate(info["model"])`` rebuilds it); ``pt2`` is a ``torch.export`` program
with the run's input normalisation in front, taking the data's uint8 images and running with
torch alone. ``model.json`` says what the weights are: the model's ``_target_`` and arguments,
class names, input mean/std and size, which checkpoint and weights, and the run's manifest.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainkit.checkpoint.load import MODEL_JSON
from trainkit.core.errors import TrainkitError

FORMATS = ("safetensors", "pt", "pt2")
INPUTS_FILE = "inputs.json"  # a run's Inputs, recorded when it trains (write_inputs)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Inputs:
    """What the model takes, as the run's data gave it: uint8 images ``[C, H, W]`` scaled to
    0..1 and normalised per channel by ``mean`` and ``std``, and the names of its classes."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    image_size: tuple[int, ...]  # (C, H, W)
    classes: Sequence[str]
    # how the run's loaders normalise, for outputs equal to its own: the tensor datasets'
    # (x - 255 mean) / (255 std), or image files' x / (255 std) - mean / std (one multiply-add)
    fused: bool = False
    transform: dict[str, Any] | None = None  # image files: how they are resized and cropped


def write_inputs(run_dir: str | Path, inputs: Inputs) -> Path:
    """``inputs`` as ``<run_dir>/inputs.json`` (written whole: beside it, then renamed), so that
    export and predict need neither the run's data nor its ``dataset._target_``'s module."""
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


class Normalized(nn.Module):
    """``model`` with the data's normalisation in front: uint8 images in, outputs out.

    The same operations, in the same float32 arithmetic, as the run's loaders
    (:class:`~trainkit.data.InMemoryLoader`, or :func:`trainkit.data.transforms.normalize`
    for image files), so its outputs equal the run's own.
    """

    def __init__(self, model: nn.Module, inputs: Inputs,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.model, self.dtype, self.fused = model, dtype, inputs.fused
        mean, std, shape = inputs.mean, inputs.std, (1, len(inputs.mean), 1, 1)
        if self.fused:  # trainkit.data.transforms.normalize's constants
            self.register_buffer("a", torch.tensor([1 / (255 * s) for s in std]).view(shape))
            self.register_buffer("b", torch.tensor([-m / s for m, s in zip(mean, std)]
                                                   ).view(shape))
        else:  # trainkit.data.loader.memory.InMemoryLoader's
            self.register_buffer("a", torch.tensor(mean).view(shape) * 255)
            self.register_buffer("b", torch.tensor(std).view(shape) * 255)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(torch.float32)
        x = torch.addcmul(self.b, x, self.a) if self.fused else x.sub(self.a).div(self.b)
        return self.model(x.to(self.dtype))


def export(model: nn.Module, out: str | Path, *, fmt: str, dtype: str, inputs: Inputs,
           info: Mapping[str, Any]) -> Path:
    """Write ``model`` (its weights, in ``dtype``) as ``fmt`` with ``model.json`` to the new
    folder ``out``; ``info``: what else model.json says (``model`` node, checkpoint, manifest).

    The folder appears whole or not at all (written beside it, then renamed).

    Raises:
        TrainkitError: ``out`` exists, an unknown format or dtype, or a model ``torch.export``
            cannot trace (the message says to use safetensors).
    """
    out = Path(out)
    if fmt not in FORMATS:
        raise TrainkitError(f"--format {fmt}: use one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise TrainkitError(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")
    if out.exists():
        raise TrainkitError(f"export folder {out} exists: remove it, or give another --out")
    if not out.parent.is_dir():
        raise TrainkitError(f"cannot write {out}: folder {out.parent} does not exist")
    model = model.to("cpu", DTYPES[dtype]).eval()
    file = f"model.{fmt}"
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # mkdir: the umask's permissions
    shutil.rmtree(tmp, ignore_errors=True)  # this process's own, left by a kill
    tmp.mkdir()
    try:
        _write_weights(model, tmp / file, fmt, DTYPES[dtype], inputs)
        record = {"format": fmt, "file": file, "dtype": str(DTYPES[dtype]).removeprefix("torch."),
                  **info, "classes": list(inputs.classes), "num_classes": len(inputs.classes),
                  "mean": list(inputs.mean), "std": list(inputs.std),
                  "image_size": list(inputs.image_size), "input": _input_words(fmt),
                  **({"eval_transform": inputs.transform} if inputs.transform else {})}
        (tmp / MODEL_JSON).write_text(json.dumps(record, indent=2, default=str) + "\n")
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_weights(model: nn.Module, path: Path, fmt: str, dtype: torch.dtype,
                   inputs: Inputs) -> None:
    if fmt == "pt2":
        torch.export.save(program(model, inputs, dtype), path)
        return
    weights = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if fmt == "pt":
        torch.save(weights, path)
        return
    from safetensors.torch import save_file

    save_file(weights, path)
    # safetensors writes its file 0600; the folder was made with the umask's mode (mkdir): the
    # file gets that, as model.json and the pt/pt2 files do
    path.chmod(path.parent.stat().st_mode & 0o666)


def program(model: nn.Module, inputs: Inputs, dtype: torch.dtype = torch.float32
            ) -> torch.export.ExportedProgram:
    """``model`` with its normalisation as a ``torch.export`` program for any batch size."""
    wrapped = Normalized(model, inputs, dtype).eval()
    example = torch.zeros((2, *inputs.image_size), dtype=torch.uint8)
    batch = torch.export.Dim("batch", min=1)
    try:
        return torch.export.export(wrapped, (example,), dynamic_shapes=({0: batch},))
    except Exception as err:  # the tracer's errors are long; the model's code is what it met
        raise TrainkitError(
            f"torch.export cannot trace {type(model).__name__} ({type(err).__name__}): export "
            "--format safetensors, which any model can use",
            details=str(err).splitlines()[:6]) from None


def _input_words(fmt: str) -> str:
    if fmt == "pt2":
        return "uint8 images [N, C, H, W] of image_size; the program normalises them"
    return "float32 images [N, C, H, W] of image_size: (pixels / 255 - mean) / std per channel"
