"""One walker over nested collections: every place that moves, copies or reads tensors in
batches and states (dicts, lists, tuples, namedtuples, dataclasses) goes through it.

Like Lightning's ``apply_to_collection``, without its options: a function for the tensors, and
everything else returned as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

KeyPath = str  # "a.b[0]": dict keys joined by dots, sequence indices in brackets


def tree_map(fn: Callable[..., Any], tree: Any, *, with_path: bool = False,
             share: bool = True) -> Any:
    """``tree`` with every tensor ``t`` replaced by ``fn(t)`` (``fn(t, path)`` with ``with_path``).

    With ``share``, a container whose items all come back unchanged is returned itself (a batch
    already on its device costs no allocation); ``share=False`` copies every container. Dict
    subclasses whose constructor takes a dict, namedtuples and dataclasses keep their type.

    Example:
        >>> tree_map(lambda t: t * 2, {"x": torch.ones(2), "id": "a"})["x"]
        tensor([2., 2.])
    """
    return _map(fn, tree, "" if with_path else None, share)


def _map(fn: Callable[..., Any], obj: Any, path: KeyPath | None, share: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj) if path is None else fn(obj, path)
    cls = type(obj)
    # Sequences before Mapping: isinstance against an ABC is slow, and this runs every step.
    if isinstance(obj, (list, tuple)):
        items = [_map(fn, v, None if path is None else f"{path}[{i}]", share)
                 for i, v in enumerate(obj)]
        if share and all(a is b for a, b in zip(items, obj)):
            return obj
        return cls(*items) if hasattr(obj, "_fields") else cls(items)  # namedtuple or not
    if isinstance(obj, Mapping):
        mapped = {k: _map(fn, v, None if path is None else _join(path, k), share)
                  for k, v in obj.items()}
        if share and all(mapped[k] is v for k, v in obj.items()):
            return obj
        try:
            return cls(mapped)  # keeps OrderedDict and other dict subclasses
        except TypeError:  # e.g. defaultdict, whose constructor wants a factory first
            return mapped
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _map(fn, getattr(obj, f.name),
                                None if path is None else _join(path, f.name), share)
                   for f in dataclasses.fields(obj) if f.init}
        if share and all(v is getattr(obj, k) for k, v in changes.items()):
            return obj
        return dataclasses.replace(obj, **changes)
    return obj


def tree_leaves(tree: Any, path: KeyPath = "") -> Iterator[tuple[KeyPath, Any]]:
    """``(path, leaf)`` for every leaf of ``tree`` -- tensors and anything else not a container
    -- in the order :func:`tree_map` visits them.

    Example:
        >>> list(tree_leaves({"a": [1, torch.zeros(())]}))
        [('a[0]', 1), ('a[1]', tensor(0.))]
    """
    if isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from tree_leaves(value, f"{path}[{i}]")
    elif isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from tree_leaves(value, _join(path, key))
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        for f in dataclasses.fields(tree):
            yield from tree_leaves(getattr(tree, f.name), _join(path, f.name))
    else:
        yield path, tree


def tensors(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``tree``, in :func:`tree_map`'s order."""
    return (leaf for _, leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor))


def _join(path: KeyPath, key: Any) -> KeyPath:
    return f"{path}.{key}" if path else str(key)
