"""``data.mix``: several corpora of one kind (``data=tokens``, ``data=hf_text``) as one run's data.

Each entry ``{root, weight}`` (optionally ``name``: its metrics' name, else the root's
basename; ``source``: its kind, which must be the run's ``data.name``: a batch holds one kind)
is loaded by the run's source as if it were ``data.root``; the splits become one
:class:`~trainkit.data.sources.source.Mixture` per split. The pipeline draws each training
sample from a part by weight (:mod:`trainkit.data.loader.mixture`) and evaluates each part's
evaluation split apart (``val/loss/<name>``). One line states the weights and each corpus's size.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import PurePosixPath
from typing import Any

import numpy as np

from trainkit.core.errors import ConfigError
from trainkit.core.runtime import Runtime
from trainkit.data.sources.source import (
    Loaded,
    MapStyle,
    Mixture,
    Options,
    Source,
    SplitPlan,
    TokenWindows,
)

log = logging.getLogger("trainkit")


def entry_name(entry: Any) -> str:
    """An entry's name: its ``name``, else its root's last part (``/data/web/`` -> ``web``)."""
    name = entry.get("name") or PurePosixPath(str(entry["root"]).rstrip("/")).name
    return str(name)


def mixture_splits(cfg: Any, source: Source, runtime: Runtime, options: Options) -> Loaded:
    """``cfg.mix``'s corpora loaded by ``source`` (each as ``data.root``) as one
    :class:`Mixture` per split, and the class count (the largest vocabulary of token corpora;
    texts' classes must agree).

    Raises:
        ConfigError: an entry of another kind, two entries of one name, corpora that cannot
            share a batch (different class names).
    """
    entries = list(cfg.mix)
    names = [entry_name(entry) for entry in entries]
    for i, entry in enumerate(entries):
        kind = entry.get("source") or cfg.name
        if kind != cfg.name:
            raise ConfigError(f"data.mix[{i}].source={kind} cannot share a batch with "
                              f"data={cfg.name}: the corpora of a mixture are of one kind")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"data.mix: two entries are named {twice[0]!r}: give each a name")
    total = float(sum(entry["weight"] for entry in entries))
    weights = tuple(float(entry["weight"]) / total for entry in entries)
    loaded = [source.load(replace(cfg, root=str(entry["root"]), mix=None), runtime, options)
              for entry in entries]
    trains = tuple(train for train, _, _ in loaded)
    _check_one_kind(names, trains)
    counts = [count for _, _, count in loaded]
    if isinstance(trains[0], TokenWindows):
        count = max(counts)  # a vocabulary: the largest holds every corpus's tokens
    elif len(set(counts)) > 1 or len({tuple(t.classes or ()) for t in trains}) > 1:
        raise ConfigError(f"data.mix: the corpora have different classes "
                          f"({describe(names, counts)}): a mixture's batches need one set")
    else:
        count = counts[0]
    vals = [(name, val) for name, (_, val, _) in zip(names, loaded) if val is not None]
    val = (Mixture(tuple(n for n, _ in vals), tuple(v for _, v in vals),
                   tuple(1.0 / len(vals) for _ in vals)) if vals else None)
    log.info("data.mix: %s", ", ".join(f"{name} weight {w:.3g} ({size_of(plan)})"
                                        for name, w, plan in zip(names, weights, trains)))
    return Mixture(tuple(names), trains, weights), val, count


def describe(names: list[str], values: list[Any]) -> str:
    """``a: 1, b: 2``: a value per corpus, for a line."""
    return ", ".join(f"{n}: {v}" for n, v in zip(names, values))


def _check_one_kind(names: list[str], trains: tuple[SplitPlan, ...]) -> None:
    """Parts one loader can mix: all token windows (of one length) or all map-style samples."""
    kinds = {type(plan) for plan in trains}
    if len(kinds) > 1 or not kinds <= {TokenWindows, MapStyle}:
        raise ConfigError("data.mix: the corpora cannot share a batch ("
                          f"{describe(names, [type(t).__name__ for t in trains])})")


def size_of(plan: SplitPlan) -> str:
    """A training split's size in words: its tokens and windows, or its samples."""
    if isinstance(plan, TokenWindows):
        tokens = plan.path.stat().st_size // np.dtype(plan.dtype).itemsize
        windows = max(0, (tokens - 1) // plan.seq_len)
        return f"{tokens:,} tokens, {windows:,} windows of {plan.seq_len}"
    assert isinstance(plan, MapStyle)
    return f"{len(plan.dataset):,} samples"
