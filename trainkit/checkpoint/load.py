"""``trainkit.load_model``: a trained model back in Python, from a run folder or an export.

The model is rebuilt from the ``model`` node the run was configured with (its ``_target_`` and
arguments, stored in every checkpoint and in an export's ``model.json``), so the user's own
classes come back as they were written, then given the chosen weights.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainkit.checkpoint.adapters import AdaptersOnly
from trainkit.checkpoint.contents import check_weights_fit
from trainkit.checkpoint.select import find_checkpoint, model_weights, read_whole
from trainkit.core.device import resolve_device
from trainkit.core.errors import TrainkitError, chain_lines
from trainkit.models.build import make_model

MODEL_JSON = "model.json"


def build_model(node: Mapping[str, Any], weights: Mapping[str, torch.Tensor], *,
                path: Any = "?", adapters_only: bool = False) -> nn.Module:
    """The model a config node describes (``{"_target_": ..., **arguments}``, and ``lora``),
    holding ``weights`` (checked to fit first: one line naming what differs). ``path``: where the
    weights come from, for the message. ``adapters_only``: ``weights`` are a LoRA run's
    trainable tensors alone (``checkpoint.adapters_only``), the base built from the node."""
    if not isinstance(node, Mapping) or "_target_" not in node:
        raise TrainkitError(f"{path} names no model to build (no model._target_ in its config)")
    try:
        model = make_model(node)
    except TrainkitError:
        raise
    except Exception as err:  # a class renamed, moved or uninstalled since the run
        raise TrainkitError(
            f"the model this run trained, model._target_={node['_target_']}, no longer builds "
            f"here: install or fix its module, or name another with model._target_=...",
            details=[f"weights: {path}", *chain_lines(err)]) from None
    target = AdaptersOnly(model) if adapters_only else model
    weights = with_shared(target, weights)
    check_weights_fit(target.state_dict(), weights, key="ckpt", path=path)
    target.load_state_dict(weights)
    return model


def with_shared(model: nn.Module, weights: Mapping[str, torch.Tensor]
                ) -> Mapping[str, torch.Tensor]:
    """``weights`` and, for each name of ``model`` they lack that shares its tensor with a name
    they have (tied input and output embeddings, which ``save_pretrained`` writes once), that
    tensor."""
    here = model.state_dict()
    if all(name in weights for name in here):
        return weights

    def place(t: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
        return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)

    held = {place(t): name for name, t in here.items()
            if name in weights and t.numel() and not t.is_meta}
    twins = {name: held.get(place(t)) for name, t in here.items() if name not in weights}
    return {**weights, **{name: weights[twin] for name, twin in twins.items() if twin}}


def load_model(source: str | Path, ckpt: str = "best", *, device: str | torch.device = "cpu",
               weights: str = "auto") -> nn.Module:
    """A trained model in eval mode on ``device``, with the chosen weights.

    Args:
        source: a run folder (its ``checkpoints/``, either layout, FSDP's sharded ones too) or a
            folder ``trainkit export`` wrote. A ``pt2`` export loads as its program's module,
            which takes uint8 images ``[N, C, H, W]`` (the normalisation is inside it).
        ckpt: for a run folder: ``best``, ``last``, ``step_N`` or a checkpoint's path.
        device: e.g. ``"cpu"``, ``"cuda:1"``, ``"auto"``.
        weights: ``auto`` (the EMA's when the run kept one), ``ema`` or ``raw``.

    Raises:
        TrainkitError: no such checkpoint, weights that do not fit the model, and the like.

    Example:
        >>> model = trainkit.load_model("outputs/2026-12-04/10-00-00", ckpt="best")
        ... # doctest: +SKIP
        >>> logits = model(images)
    """
    source = Path(source)
    target = resolve_device(device)  # "auto", "cuda:1", ...: checked to exist here
    if (source / MODEL_JSON).is_file():
        model = load_export(source)
        if isinstance(model, torch.fx.GraphModule):  # a pt2 program: traced in eval mode
            return model.to(target)
    else:
        state = read_whole(find_checkpoint(source, ckpt))
        chosen, which = model_weights(state, weights)
        config = state.get("config") or {}
        model = build_model(config.get("model"), chosen, path=state["_path"],
                            adapters_only=_adapters_only(config, which))
    return model.to(target).eval()


def load_export(folder: str | Path) -> nn.Module:
    """The model of an export folder, as :func:`load_model` returns it (on the CPU)."""
    folder = Path(folder)
    info = json.loads((folder / MODEL_JSON).read_text())
    file = folder / info["file"]
    if info["format"] == "pt2":
        return torch.export.load(file).module()
    if info["format"] == "safetensors":
        from safetensors.torch import load_file

        tensors = load_file(file)
    else:
        tensors = torch.load(file, map_location="cpu", weights_only=True)
    model = build_model(info["model"], tensors, path=file)
    dtype = getattr(torch, info["dtype"]) if info.get("dtype") else None
    return model.to(dtype) if dtype is not None else model


def _adapters_only(config: Mapping[str, Any], weights: str) -> bool:
    """Whether a checkpoint's chosen weights are a LoRA run's adapters alone (the EMA's are
    whole)."""
    return bool((config.get("checkpoint") or {}).get("adapters_only")) and weights != "ema"
