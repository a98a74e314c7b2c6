"""Which parameters train, and with which learning rate and weight decay: for any ``nn.Module``.

:func:`apply_freeze` freezes ``trainer.freeze`` (glob patterns on names) until
``trainer.unfreeze_at_epoch``, called before the model is wrapped and at every epoch's start, so
a resumed run is frozen as the run it continues. :func:`param_groups` builds the optimizer's
groups (``optim.param_groups``, ``optim.layer_decay`` in timm's meaning, no decay on biases and
norms), frozen parameters included: the optimizer's state then has one shape before and after
unfreezing. :func:`describe` says what trains in the first log line.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from trainkit.core.errors import ConfigError

log = logging.getLogger("trainkit")
KEYS = ("param_groups", "layer_decay", "decay_norm_and_bias", "adamw_params")  # read here
# Model families layer decay knows: (block index pattern, stem pattern); blocks count from 1,
# the stem is layer 0, anything else (the head, a final norm) the top layer.
FAMILIES = {
    "ResNet": (r"(?:^|\.)layer(\d+)\.", r"(?:^|\.)(?:conv1|bn1)\."),
    "VisionTransformer": (r"(?:^|\.)(?:encoder_layer_|blocks\.)(\d+)\.",
                          r"(?:^|\.)(?:conv_proj|class_token|pos_embedding|patch_embed|cls_token"
                          r"|pos_embed)(?:\.|$)"),
    "GPT": (r"(?:^|\.)blocks\.(\d+)\.", r"(?:^|\.)(?:tokens|positions)\."),
}
_NO_DECAY_NAMES = ("pos_embed", "pos_embedding", "cls_token", "class_token")


def matching(model: nn.Module, patterns: Sequence[str], key: str) -> list[str]:
    """The names of ``model``'s parameters that match any of the glob ``patterns``.

    Raises:
        ConfigError: a pattern matches no parameter (the message shows what names look like).
    """
    names = [name for name, _ in model.named_parameters()]
    found = []
    for pattern in patterns:
        hits = fnmatch.filter(names, pattern)
        if not hits:
            raise ConfigError(f"{key}: {pattern!r} matches no parameter of "
                              f"{type(model).__name__} (names look like {', '.join(names[:3])}"
                              f", ..., {names[-1]}): fix the pattern (a glob, e.g. 'layer1.*')")
        found += hits
    return sorted(set(found), key=names.index)


def apply_freeze(model: nn.Module, config: Any, epoch: int, *, world_size: int = 1) -> None:
    """Freeze the parameters ``config.freeze`` names for epoch ``epoch`` (counted from 0), or
    unfreeze them from ``config.unfreeze_at_epoch`` on (said once in the log); ``config``: the
    trainer's settings. Nothing to do without patterns.

    Raises:
        ConfigError: a pattern matches no parameter; ``unfreeze_at_epoch`` over several ranks
            (DDP and FSDP fix which parameters get gradients when they wrap the model).
    """
    freeze, unfreeze_at_epoch = config.freeze, config.unfreeze_at_epoch
    if not freeze:
        return
    if unfreeze_at_epoch is not None and world_size > 1:
        raise ConfigError("trainer.unfreeze_at_epoch runs in one process only (DDP and FSDP fix "
                          "which parameters train when they wrap the model): set it to null, "
                          "or run the frozen and the unfrozen phases as two runs")
    names = set(matching(model, freeze, "trainer.freeze"))
    train = unfreeze_at_epoch is not None and epoch >= unfreeze_at_epoch
    changed = 0
    for name, param in model.named_parameters():
        if name in names and param.requires_grad != train:
            param.requires_grad_(train)
            changed += 1
    if train and changed:
        log.info("epoch %d: %d parameter tensors (%s) unfrozen (trainer.unfreeze_at_epoch=%d)",
                 epoch + 1, changed, _count(sum(p.numel() for n, p in model.named_parameters()
                                                if n in names)), unfreeze_at_epoch)


def param_groups(model: nn.Module, *, lr: float | None = None,
                 groups: Sequence[Mapping[str, Any]] = (), layer_decay: float | None = None,
                 decay_norm_and_bias: bool = True) -> list[dict[str, Any]]:
    """Every parameter of ``model`` in a group of its settings, each group named (``name``).

    Args:
        lr: the optimizer's own lr (scaled by ``layer_decay``; needed only with it).
        groups: ``[{"params": pattern or [patterns], "lr": ..., ...}]``; other keys are the
            optimizer's options for that group.
        layer_decay: each layer's lr scaled by ``layer_decay ** (top - layer)`` (timm's).
        decay_norm_and_bias: false: weight decay 0 on biases, norms (1-D tensors), embeddings.

    Example:
        >>> groups = param_groups(model, lr=1e-3, layer_decay=0.75,
        ...                       groups=[{"params": "fc.*", "lr": 1e-2}])  # doctest: +SKIP
        >>> optimizer = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.05)
    """
    owner = [_group_of(model, dict(g), i) for i, g in enumerate(groups)]
    layer = layer_ids(model) if layer_decay is not None else {}
    if layer and lr is None:
        raise ConfigError("optim.layer_decay scales optim.lr: give optim.lr")
    top = max(layer.values(), default=0)
    no_decay = set() if decay_norm_and_bias else no_decay_names(model)
    built: dict[tuple[Any, ...], dict[str, Any]] = {}
    for name, param in model.named_parameters():
        index = next((i for i, (names, _) in enumerate(owner) if name in names), None)
        options = dict(owner[index][1]) if index is not None else {}
        label = str(groups[index].get("name", f"group{index}")) if index is not None else ""
        depth = layer.get(name)
        if depth is not None:
            options["lr"] = options.get("lr", lr) * layer_decay ** (top - depth)
            label += f"{'.' if label else ''}layer{depth}"
        if name in no_decay:
            options["weight_decay"] = 0.0
            label += f"{'.' if label else ''}no_decay"
        group = built.setdefault((index, depth, name in no_decay),
                                 {"name": label or "default", "params": [], **options})
        group["params"].append(param)
    return list(built.values())


def _group_of(model: nn.Module, group: dict[str, Any], index: int
              ) -> tuple[set[str], dict[str, Any]]:
    key = f"optim.param_groups[{index}]"
    if "params" not in group:
        raise ConfigError(f"{key} has no params: give a pattern of parameter names, e.g. "
                          "{params: 'fc.*', lr: 0.01}")
    patterns = group.pop("params")
    group.pop("name", None)
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    return set(matching(model, patterns, key)), group


def check_options(optimizer: torch.optim.Optimizer) -> None:
    """Refuse a group option the optimizer does not have (torch would keep it, unread)."""
    for group in optimizer.param_groups:
        unknown = sorted(set(group) - set(optimizer.defaults) - {"params", "name", "initial_lr"})
        if unknown:
            raise ConfigError(f"optim.param_groups: {', '.join(unknown)} is not an option of "
                              f"{type(optimizer).__name__} (its: {', '.join(optimizer.defaults)})"
                              f": remove it or use one of those")


def no_decay_names(model: nn.Module) -> set[str]:
    """Biases, norms (every tensor of one dimension or less), embeddings (``nn.Embedding``'s
    weights, position embeddings and class tokens) and what ``model.no_weight_decay()`` names
    (timm's convention): the parameters the GPT-2 and ViT recipes do not decay."""
    names = {n for n, p in model.named_parameters() if p.ndim <= 1}
    for prefix, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            names |= {f"{prefix}.{n}" if prefix else n for n, _ in
                      module.named_parameters(recurse=False)}
        own = getattr(module, "no_weight_decay", None)
        if callable(own):
            names |= {f"{prefix}.{n}" if prefix else n for n in own()}
    names |= {n for n, _ in model.named_parameters()
              if n.rsplit(".", 1)[-1] in _NO_DECAY_NAMES}
    return names


def layer_ids(model: nn.Module) -> dict[str, int]:
    """Each parameter's layer for layer decay, 0 the stem: by timm's ``group_matcher`` for
    timm models, else by the :data:`FAMILIES` of the network inside ``model`` (also when
    wrapped, e.g. by PEFT).

    Raises:
        ConfigError: no known family (the message names those known).
    """
    for prefix, module in model.named_modules():
        if hasattr(module, "group_matcher"):  # a timm model: timm's own numbering
            from timm.models import group_parameters

            layer = group_parameters(module, module.group_matcher(coarse=False), reverse=True)
            return {(f"{prefix}.{n}" if prefix else n): i for n, i in layer.items()}
        if type(module).__name__ in FAMILIES:
            return _by_family(model, *FAMILIES[type(module).__name__])
    raise ConfigError(f"optim.layer_decay: no layer numbering for {type(model).__name__} "
                      f"(known: {', '.join(FAMILIES)} and timm models); set optim.layer_decay="
                      "null and give optim.param_groups instead")


def _by_family(model: nn.Module, block: str, stem: str) -> dict[str, int]:
    names = [name for name, _ in model.named_parameters()]
    found = {name: int(m.group(1)) for name in names if (m := re.search(block, name))}
    first = min(found.values(), default=0)
    top = max(found.values(), default=0) - first + 2
    return {name: found[name] - first + 1 if name in found else 0 if re.search(stem, name)
            else top for name in names}


def peak_lr(group: Mapping[str, Any]) -> float:
    """A param group's configured (peak) learning rate, not the one its schedule has set now:
    a warm-up starts below it (OneCycleLR keeps it as ``max_lr``, torch's other schedules as
    ``initial_lr``)."""
    return float(group.get("max_lr", group.get("initial_lr", group.get("lr", 0.0))))


def describe(model: nn.Module, optimizer: torch.optim.Optimizer | None,
             schedule: str = "") -> str:
    """``"11.2M parameters: 2.1K train, 11.2M frozen; 2 groups: head lr 0.01, default lr
    0.001"``: the first log line's words (groups summarised when there are many), each lr the
    configured peak (:func:`peak_lr`), followed by ``schedule`` (the schedule in words)."""
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    text = f"{_count(total)} parameters" + (
        f": {_count(total - frozen)} train, {_count(frozen)} frozen" if frozen else "")
    groups = getattr(optimizer, "param_groups", [])
    lrs = [peak_lr(g) for g in groups]
    if len(groups) == 1:
        text += f"; peak lr {lrs[0]:.3g}"
    elif len(groups) > 4:
        text += f"; {len(groups)} groups, peak lr {min(lrs):.3g} to {max(lrs):.3g}"
    elif groups:
        text += f"; {len(groups)} groups: " + ", ".join(
            f"{g.get('name', i)} lr {lr:.3g} wd {g.get('weight_decay', 0.0):.3g}"
            for i, (g, lr) in enumerate(zip(groups, lrs)))
    return text + (f"; {schedule}" if schedule and groups else "")


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def build_optimizer(model: nn.Module, node: Mapping[str, Any],
                    make: Callable[[dict[str, Any], list[dict[str, Any]]], Any]) -> Any:
    """The optimizer a config node describes, on :func:`param_groups` of ``model``: the keys
    :data:`KEYS` read here, the others (``_target_``, ``lr``, ...) given to ``make(node,
    groups)`` (the entry point's ``hydra.utils.instantiate``). A node with ``adamw_params``
    (``optim=muon``) has each group split into Muon's and AdamW's
    (:func:`trainkit.models.muon.split_groups`)."""
    node = dict(node)
    adamw_params = node.pop("adamw_params", None)
    groups, layer_decay = node.pop("param_groups", None) or [], node.pop("layer_decay", None)
    decay_all = node.pop("decay_norm_and_bias", True)
    if not isinstance(decay_all, bool):
        raise ConfigError(f"optim.decay_norm_and_bias must be true or false, got {decay_all!r}")
    if layer_decay is not None and not 0 < layer_decay <= 1:
        raise ConfigError(f"optim.layer_decay must be in (0, 1] or null, got {layer_decay}")
    if not isinstance(groups, Sequence) or not all(isinstance(g, Mapping) for g in groups):
        raise ConfigError("optim.param_groups must be a list of {params: pattern, lr: ...}, "
                          f"got {groups!r}")
    built = param_groups(model, lr=node.get("lr"), groups=groups, layer_decay=layer_decay,
                         decay_norm_and_bias=decay_all)
    if adamw_params is not None:
        from trainkit.models.muon import check_layout, split_groups

        check_layout(model, node.get("adjust_lr_fn"), list(adamw_params))
        built = split_groups(model, built, list(adamw_params))
    optimizer = make(node, built)
    check_options(optimizer)
    return optimizer
