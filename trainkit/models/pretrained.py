"""``model.pretrained``: start a model from weights of any origin, matched by name.

:func:`read_weights` reads a safetensors file, a ``.pt``/``.pth`` state dict (timm's and
torchvision's files, their ``state_dict``/``model``/``state_dict_ema`` wrappers), a trainkit
checkpoint or export folder, or a Hugging Face model folder (``model.safetensors``, a sharded
index or ``pytorch_model.bin``: read without transformers). Pickles load with
``weights_only=True``, as trainkit's checkpoints do: a file that would run code is refused.
:func:`load_pretrained` puts them into a model: a weight of another shape (a head for another
class count) keeps the model's own initialisation, missing and unexpected names are listed,
and more than :data:`MAX_MISSING` of the model's weights missing stops the run.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainkit.core.errors import ConfigError, one_line
from trainkit.core.location import RUN_CONFIG, recorded_dir

log = logging.getLogger("trainkit")

# More than this fraction of the model's weights not in the file (by name or shape): the file is
# of another model, and training from it would be training from random weights.
MAX_MISSING = 0.5
_WRAPPERS = ("state_dict_ema", "model_ema", "state_dict", "model", "module", "params")
_PREFIXES = ("module.", "_orig_mod.")
_HF_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
             "pytorch_model.bin.index.json")
_SHOWN = 6  # names shown per log line


def read_weights(path: str | Path) -> tuple[dict[str, torch.Tensor], str]:
    """The state dict a weights file or folder holds, and which of its weights they are.

    Raises:
        ConfigError: no such path, or not weights (random bytes, a pickle that names code, a
            folder of none of the known layouts): one line saying what to give instead.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise ConfigError(f"model.pretrained={path}: no such file or folder; give a weights "
                          "file (.safetensors, .pt, .pth, .bin) or a model folder")
    if path.is_dir():
        return _read_folder(path)
    return _unwrap(_read_file(path), path)


def _read_folder(path: Path) -> tuple[dict[str, torch.Tensor], str]:
    if (path / "model.json").is_file():  # `trainkit export`
        info = json.loads((path / "model.json").read_text())
        if info.get("format") == "pt2":
            raise ConfigError(f"model.pretrained={path} is a pt2 export (a program, not a "
                              "state dict): export it with --format safetensors")
        return _unwrap(_read_file(path / info["file"]), path)
    for name in _HF_FILES:  # a Hugging Face model folder: its weights, whole or sharded
        if (path / name).is_file():
            if not name.endswith(".index.json"):
                return _unwrap(_read_file(path / name), path)
            shards = sorted(set(json.loads((path / name).read_text())["weight_map"].values()))
            weights: dict[str, torch.Tensor] = {}
            for shard in shards:
                weights.update(_read_file(path / shard))
            return weights, "its weights"
    if (path / RUN_CONFIG).is_file() or (path / "checkpoints").is_dir():
        where = recorded_dir(path) or path / "checkpoints"  # where the run wrote them
        raise ConfigError(f"model.pretrained={path} is a run: give one of its checkpoint files "
                          f"(in {where}), or `trainkit export` the run and give its folder")
    if (path / ".metadata").is_file():
        raise ConfigError(f"model.pretrained={path} is a sharded checkpoint: `python -m "
                          "trainkit.checkpoint consolidate` it into one file and give that")
    raise ConfigError(f"model.pretrained={path}: a folder without weights (no model.json, "
                      f"{', '.join(_HF_FILES[::2])}); give a weights file or a model folder")


def _read_file(path: Path) -> Any:
    """A file's contents on the CPU: safetensors, or a pickle holding only tensors and plain
    containers (``weights_only``: a pickle that names any other global is refused)."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ConfigError(f"model.pretrained={path} is not a weights file that loads safely "
                          f"({_why(err)}): give a state dict (.safetensors, .pt) or a model "
                          "folder") from None


def _why(err: BaseException) -> str:
    """The few words of torch's weights-only refusal that say what the file held."""
    text = str(err)
    if named := re.search(r"GLOBAL (\S+)", text):
        return f"it names {named.group(1)}: a pickled object or code, not tensors"
    if "WeightsUnpickler error:" in text:  # bytes that are no pickle torch writes
        return one_line(text.split("WeightsUnpickler error:", 1)[1].strip().splitlines()[0], 60)
    return one_line(err, 80)


def _unwrap(content: Any, path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """The state dict inside what a file held: a trainkit checkpoint's (its EMA's when it kept
    one, as evaluations used), timm's (``state_dict_ema`` first), torchvision's plain one; with
    DDP's ``module.`` and torch.compile's ``_orig_mod.`` prefixes removed."""
    which = "its weights"
    if isinstance(content, Mapping) and "global_step" in content and "model" in content:
        ema = (content.get("ema") or {}).get("weights")
        content, which = (ema, "its EMA weights") if ema is not None else (content["model"],
                                                                          which)
    while isinstance(content, Mapping) and not _all_tensors(content):
        wrapper = next((key for key in _WRAPPERS if isinstance(content.get(key), Mapping)), None)
        if wrapper is None:
            raise ConfigError(f"model.pretrained={path} holds no state dict (keys: "
                              f"{', '.join(map(str, list(content)[:6]))}): give a file of "
                              "name -> tensor")
        content = content[wrapper]
        which = "its EMA weights" if "ema" in wrapper else which
    if not isinstance(content, Mapping):
        raise ConfigError(f"model.pretrained={path} holds a {type(content).__name__}, not a "
                          "state dict: give a file of name -> tensor")
    return {_strip(str(name)): tensor for name, tensor in content.items()}, which


def _all_tensors(content: Mapping[str, Any]) -> bool:
    return bool(content) and all(isinstance(v, torch.Tensor) for v in content.values())


def _strip(name: str) -> str:
    while name.startswith(_PREFIXES):
        name = name.split(".", 1)[1]
    return name.replace("._orig_mod.", ".")


def load_pretrained(model: nn.Module, path: str | Path, *,
                    max_missing: float = MAX_MISSING) -> dict[str, list[str]]:
    """Load the weights at ``path`` into ``model`` by name, before any wrapping (DDP, FSDP,
    compile); return the names ``{"loaded", "reshaped", "missing", "unexpected"}``.

    A weight of another shape (a head for another class count) keeps the model's initialisation;
    each kind of mismatch is said in one line. Keys under a common prefix (``bert.``) match too.

    Raises:
        ConfigError: not a weights file (:func:`read_weights`), or more than ``max_missing``
            of the model's weights not in it: the first names.

    Example:
        >>> model = torchvision.models.resnet18(num_classes=4)  # doctest: +SKIP
        >>> load_pretrained(model, "resnet18-imagenet.pth")  # fc re-initialised for 4 classes
    """
    saved, which = read_weights(path)
    here = model.state_dict()
    saved = _aligned(saved, here)
    reshaped = [k for k, t in here.items() if k in saved and saved[k].shape != t.shape]
    missing = [k for k in here if k not in saved]
    unexpected = [k for k in saved if k not in here]
    lost = len(missing) + len(reshaped)
    if here and lost > max_missing * len(here):
        raise ConfigError(
            f"model.pretrained={path} fits {len(here) - lost} of this model's {len(here)} "
            f"weights (more than {max_missing:.0%} missing or of another shape: "
            f"{_names(missing + reshaped, 3)}): give the weights of this architecture")
    loaded = {k: t for k, t in saved.items() if k in here and k not in reshaped}
    model.load_state_dict(loaded, strict=False)
    log.info("model.pretrained: %d of %d weights loaded from %s (%s)", len(loaded), len(here),
             path, which)
    if reshaped:
        log.info("model.pretrained: re-initialised, of another shape here: %s", ", ".join(
            f"{k} {list(saved[k].shape)} -> {list(here[k].shape)}" for k in reshaped[:_SHOWN])
            + (f" and {len(reshaped) - _SHOWN} more" if len(reshaped) > _SHOWN else ""))
    if missing:
        log.info("model.pretrained: missing in the file (the model's own initialisation): %s",
                 _names(missing))
    if unexpected:
        log.info("model.pretrained: in the file but not in this model (ignored): %s",
                 _names(unexpected))
    return {"loaded": list(loaded), "reshaped": reshaped, "missing": missing,
            "unexpected": unexpected}


def _aligned(saved: dict[str, torch.Tensor], here: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``saved`` renamed as matches the most of ``here``'s names: as they are, only those under
    one first name with it removed (a base model inside a task model's file), or all with one
    of ``here``'s first names put in front."""
    def heads(names: Any) -> set[str]:
        return {name.split(".", 1)[0] + "." for name in names if "." in name}

    candidates = [saved]
    candidates += [{k.removeprefix(p): t for k, t in saved.items() if k.startswith(p)}
                   for p in heads(saved)]
    candidates += [{p + k: t for k, t in saved.items()} for p in heads(here)]
    return max(candidates, key=lambda c: len(c.keys() & here.keys()))


def _names(names: list[str], shown: int = _SHOWN) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{len(names)}: " + ", ".join(names[:shown]) + more
