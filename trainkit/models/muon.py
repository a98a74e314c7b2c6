"""Muon on a model's 2-D hidden weights, AdamW on the rest, as one optimizer (``optim=muon``).

:func:`hidden_matrices` picks the parameters by name and shape before any wrapping: every 2-D
weight except embeddings (``nn.Embedding``, position embeddings, class tokens), the output
layer (a module named ``head``, ``lm_head``, ``fc``, ``classifier``, ``output`` or ``heads``, or
a Hugging Face model's ``get_output_embeddings()``) and what ``optim.adamw_params`` names.
:class:`MuonAdamW` holds torch's own ``torch.optim.Muon`` and ``torch.optim.AdamW`` and shows
the loop, LR schedulers and checkpoints one ``torch.optim.Optimizer``: their param groups (the
same dicts), one ``state``, one ``state_dict``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from trainkit.core.errors import ConfigError
from trainkit.models.param_groups import no_decay_names

HEAD_NAMES = ("head", "lm_head", "fc", "classifier", "output", "heads")  # output layers
FSDP_REFUSAL = ("optim=muon runs in one process or under trainer.strategy=ddp: torch.optim.Muon "
                "orthogonalises whole matrices, and on FSDP2's row shards (DTensors) its update "
                "is not the unsharded one; set trainer.strategy=ddp, or optim=adamw for FSDP")
MUON = "muon"  # the group key that sends a group to Muon (True) or AdamW (False)


def hidden_matrices(model: nn.Module, adamw_params: Sequence[str] = ()) -> list[str]:
    """The names of ``model``'s parameters Muon updates: 2-D, not an embedding, not the output
    layer, not matched by a glob of ``adamw_params``."""
    names = [name for name, _ in model.named_parameters()]
    kept = set(no_decay_names(model))  # embeddings, class tokens, norms, biases
    output = getattr(model, "get_output_embeddings", None)
    heads = [output()] if callable(output) and output() is not None else []
    heads += [module for name, module in model.named_modules()
              if name and name.rsplit(".", 1)[-1] in HEAD_NAMES]
    by_id = {id(p): n for n, p in model.named_parameters()}
    kept |= {by_id[id(p)] for head in heads for p in head.parameters() if id(p) in by_id}
    for pattern in adamw_params:
        hits = fnmatch.filter(names, pattern)
        if not hits:
            raise ConfigError(f"optim.adamw_params: {pattern!r} matches no parameter of "
                              f"{type(model).__name__} (names look like {names[0]}, ...): fix "
                              "the glob pattern")
        kept |= set(hits)
    return [name for name, p in model.named_parameters() if p.ndim == 2 and name not in kept]


def check_layout(model: nn.Module, adjust_lr_fn: str | None,
                 adamw_params: Sequence[str] = ()) -> None:
    """Refuse an ``adjust_lr_fn`` that reads a matrix as ``(out, in)`` (torch's ``original``,
    its default, and ``spectral_unclamped``: a ratio of the two) for a model whose hidden
    matrices are stored ``(in, out)``, as the ``Conv1D`` layers of Hugging Face's GPT-2: their
    update would be scaled by the inverse ratio. ``match_rms_adamw`` reads both ways alike.

    Raises:
        ConfigError: such a matrix among :func:`hidden_matrices` with such an ``adjust_lr_fn``.
    """
    if adjust_lr_fn not in (None, "original", "spectral_unclamped"):
        return
    hidden = set(hidden_matrices(model, adamw_params))
    for name, module in model.named_modules():
        # transformers' Conv1D (GPT-2's layers): weight (nx, nf), y = x @ W + b
        if type(module).__name__ == "Conv1D" and f"{name}.weight" in hidden:
            raise ConfigError(
                f"optim.adjust_lr_fn={adjust_lr_fn or 'original'} reads a matrix as (out, in), "
                f"but {type(model).__name__}'s {name}.weight is (in, out) (a Conv1D): set "
                "optim.adjust_lr_fn=match_rms_adamw")


def split_groups(model: nn.Module, groups: Iterable[Mapping[str, Any]],
                 adamw_params: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Each of ``groups`` (:func:`trainkit.models.param_groups.param_groups`) split in two: its
    :func:`hidden_matrices` with ``muon: True``, the others with ``muon: False``; empty ones
    dropped. Muon's groups come first."""
    hidden = set(hidden_matrices(model, adamw_params))
    if not hidden:
        raise ConfigError(f"optim=muon: {type(model).__name__} has no 2-D hidden weight for "
                          "Muon (embeddings, the output layer and optim.adamw_params stay on "
                          "AdamW): use optim=adamw")
    name_of = {id(p): n for n, p in model.named_parameters()}
    split: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    for group in groups:
        for muon in (True, False):
            params = [p for p in group["params"] if (name_of[id(p)] in hidden) == muon]
            if params:
                label = f"{group.get('name', 'default')}.{'muon' if muon else 'adamw'}"
                split[muon].append({**group, "params": params, "name": label, MUON: muon})
    return split[True] + split[False]


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on the groups marked ``muon: True``, ``torch.optim.AdamW`` on the
    others, stepped together as one optimizer.

    Args:
        params: param groups, each with ``muon`` (see :func:`split_groups`).
        lr, weight_decay, momentum, nesterov, ns_steps, adjust_lr_fn: Muon's.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay, fused: AdamW's (``adamw_lr``
            and ``adamw_weight_decay`` None: Muon's ``lr`` and ``weight_decay``, which
            ``adjust_lr_fn="match_rms_adamw"`` makes fit both).
    """

    def __init__(self, params: Iterable[dict[str, Any]], lr: float = 0.02,
                 weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, adjust_lr_fn: str | None = None,
                 adamw_lr: float | None = None, adamw_betas: Sequence[float] = (0.9, 0.95),
                 adamw_eps: float = 1e-8, adamw_weight_decay: float | None = None,
                 fused: bool | None = None) -> None:
        groups = [dict(g) for g in params]
        if any(MUON not in g for g in groups):
            raise ConfigError("MuonAdamW: every param group needs a 'muon' key (build the "
                              "groups with trainkit.models.muon.split_groups)")
        flags = [bool(g.pop(MUON)) for g in groups]
        muon = [g for g, flag in zip(groups, flags, strict=True) if flag]
        adamw = [g for g, flag in zip(groups, flags, strict=True) if not flag]
        if not muon:
            raise ConfigError("optim=muon: no parameter group for Muon: use optim=adamw")
        self.optimizers: list[torch.optim.Optimizer] = [torch.optim.Muon(
            muon, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)]
        if adamw:
            self.optimizers.append(torch.optim.AdamW(
                adamw, lr=lr if adamw_lr is None else adamw_lr, betas=tuple(adamw_betas),
                eps=adamw_eps, fused=fused,
                weight_decay=weight_decay if adamw_weight_decay is None else adamw_weight_decay))
        # the inner optimizers' own group dicts: a scheduler setting an lr here sets theirs
        super().__init__([g for opt in self.optimizers for g in opt.param_groups], {})
        self.defaults = {k: v for opt in reversed(self.optimizers) for k, v in opt.defaults.items()}
        self._link()

    def _link(self) -> None:
        """Give the inner optimizers this one's groups (in order) and its one ``state``."""
        start = 0
        for opt in self.optimizers:
            count = len(opt.param_groups)
            opt.param_groups = self.param_groups[start:start + count]
            opt.state = self.state  # keyed by parameter: the two sets never meet
            start += count

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One step of each inner optimizer (``closure``, if given, evaluated once first)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``Optimizer.load_state_dict``, then the inner optimizers re-linked to the
        new groups and state it made."""
        super().load_state_dict(state_dict)
        self._link()
