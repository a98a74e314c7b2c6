"""Refuse a config key that no part of trainkit reads, naming the closest one that is read.

Hydra's ``+key=value`` adds a key inside ``open_dict`` (its documented meaning: append to the
config), which lifts the struct mode that refuses ``key=value`` for an unknown key, and
``OmegaConf.to_object`` then sets the extra key on the dataclass as a plain attribute. So
``+trainer.max_step=20`` -- what Hydra itself advises after a typo'd ``trainer.max_step=20`` --
ran the full length with the typo saved in the config. Every typed node (a structured config:
``trainer``, ``data``, ``checkpoint``, ``trainer.profile``, the root, and any dataclass added
later) is checked here against its dataclass's fields; ``_target_`` nodes (``model``,
``optim``, ...) are their classes' arguments, which their call checks. Without the ``+``,
Hydra refuses the key itself; :func:`unknown_key_line` words that refusal the same way.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterator

from omegaconf import DictConfig, OmegaConf

from trainkit.config import TrainConfig
from trainkit.core.errors import ConfigError


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
