"""The entry point's config: where its YAML folder is, the schema it fills in, and the refusal
of a key no part of trainkit reads.

Hydra's ``+key=value`` lifts struct mode, so ``+trainer.max_step=20`` (a typo Hydra itself
suggests adding) would run with the key saved and ignored: every typed node is checked here
against its dataclass, naming the closest real key. ``_target_`` nodes are their classes' calls.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from trainkit.config import TrainConfig
from trainkit.core.errors import ConfigError

_PACKAGE = Path(__file__).resolve().parents[1]  # trainkit/, above core/


def config_dir() -> Path:
    """The folder holding ``train.yaml`` and the config groups (``exp/``, ``model/``, ...).

    A wheel ships ``configs/`` inside the package (pyproject.toml maps it there) and that copy
    comes first: in site-packages a sibling ``configs/`` may be another distribution's. A
    checkout or editable install finds the repository's top-level ``configs/``.
    """
    for candidate in (_PACKAGE / "configs", _PACKAGE.parent / "configs"):
        if (candidate / "train.yaml").is_file():
            return candidate
    return _PACKAGE / "configs"  # a broken install: Hydra's own error names the folder


def schema() -> Any:
    """``TrainConfig`` as ``train.yaml``'s ``train_schema``, with ``data.root`` required: each
    data config gives its own, so ``data=image_folder`` (``root: ???``) cannot fall back to the
    built-in datasets' folder."""
    node = OmegaConf.structured(TrainConfig)
    node.data.root = MISSING
    return node


def check_known_keys(cfg: DictConfig) -> None:
    """Raise one line naming each key of a typed node that its dataclass lacks.

    Raises:
        ConfigError: ``trainer.max_step`` is not a setting: did you mean ``trainer.max_steps``?
    """
    unknown = [_named(key, fields) for key, fields in _unknown_keys(cfg, "")]
    if unknown:
        raise ConfigError(_line(unknown))


def unknown_key_line(key: str) -> str | None:
    """The line for ``key`` (a dotted path) that Hydra refused to override, when its parent is a
    typed node (None otherwise: Hydra's own words stay)."""
    parent, _, _ = key.rpartition(".")
    node = OmegaConf.structured(TrainConfig)
    for part in filter(None, parent.split(".")):
        if part not in node or not _typed(OmegaConf.get_type(node, part)):
            return None
        node = node[part]
    return _line([_named(key, _fields(OmegaConf.get_type(node)))])


def _line(unknown: list[str]) -> str:
    return (f"{'; '.join(unknown)} (no part of trainkit reads "
            f"{'it' if len(unknown) == 1 else 'them'}: fix or drop the override)")


def _named(key: str, fields: list[str]) -> str:
    """``key`` and the field whose name is closest to its last part, if one is close."""
    prefix, _, name = key.rpartition(".")
    close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
    return f"{key} is not a setting" + (
        f": did you mean {prefix + '.' if prefix else ''}{close[0]}?" if close else "")


def _typed(schema: object) -> bool:
    return isinstance(schema, type) and dataclasses.is_dataclass(schema)


def _fields(schema: type) -> list[str]:
    return [field.name for field in dataclasses.fields(schema)]


def _unknown_keys(node: DictConfig, prefix: str) -> Iterator[tuple[str, list[str]]]:
    """``(key, its node's field names)`` for each key of ``node`` (and the typed nodes inside it)
    that its dataclass has no field for. Leaves are not read: a ``???`` stays unresolved."""
    schema = OmegaConf.get_type(node)
    if not _typed(schema):
        return
    fields = _fields(schema)
    for key in node:
        if key not in fields:
            yield f"{prefix}{key}", fields
        elif _typed(OmegaConf.get_type(node, key)):
            yield from _unknown_keys(node[key], f"{prefix}{key}.")
