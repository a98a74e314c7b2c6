"""``data=tokens``: windows of a token corpus read through a memory map (nanoGPT's format).

A corpus is a folder of ``train.bin`` and ``val.bin`` (flat uint16 or uint32 token ids) and
optionally ``meta.json`` (``python -m trainkit.data tokenize`` writes all three); a URL is
fetched once into a local cache (:mod:`trainkit.data.remote`). Nothing is read whole: the
splits are :class:`~trainkit.data.sources.source.TokenWindows`, which the pipeline serves
through :class:`~trainkit.data.loader.tokens.TokenLoader` (the windows' order is its).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainkit.config import TokensConfig
from trainkit.core.errors import ConfigError
from trainkit.core.location import fetched
from trainkit.core.runtime import Runtime
from trainkit.data.remote import fetch_files
from trainkit.data.sources.source import Loaded, Options, Source, TokenWindows


def corpus_meta(root: Path) -> dict[str, Any]:
    """``meta.json`` beside the token files, or ``{}`` when there is none (nanoGPT's own)."""
    meta = root / "meta.json"
    return json.loads(meta.read_text()) if meta.is_file() else {}


def token_windows(cfg: TokensConfig, *, eval_max_batches: int | None = None) -> Loaded:
    """The training and evaluation windows of ``<data.root>/train.bin`` and ``val.bin``, and
    the vocabulary's size: ``data.num_classes`` when set (at least meta.json's: a model may have
    unused tokens), else ``meta.json``'s (one of the two is needed).

    The dtype is ``data.token_dtype``, else meta.json's, else uint16 (nanoGPT's default).
    ``eval_max_batches`` bounds the evaluation to windows spread evenly over ``val.bin``.
    """
    # a URL: the files fetched once into the local cache, checked, and mapped from there
    root = fetched(cfg.root, lambda url: fetch_files(url, ("train.bin", "val.bin"),
                                                     optional=("meta.json",)))
    if not root.is_dir():
        raise ConfigError(f"data.root={cfg.root} is not a folder: point it at the folder of "
                          "train.bin and val.bin (python -m trainkit.data tokenize writes them)")
    meta = corpus_meta(root)
    dtype = cfg.token_dtype or meta.get("dtype", "uint16")
    if cfg.token_dtype and meta.get("dtype", cfg.token_dtype) != cfg.token_dtype:
        raise ConfigError(f"data.token_dtype={cfg.token_dtype} but {root / 'meta.json'} says "
                          f"{meta['dtype']}: drop data.token_dtype")
    vocab = meta.get("vocab_size")
    if cfg.num_classes is not None and vocab is not None and cfg.num_classes < vocab:
        raise ConfigError(f"data.num_classes={cfg.num_classes} but {root / 'meta.json'} says "
                          f"the vocabulary has {vocab} tokens: leave data.num_classes unset")
    if cfg.num_classes is None and vocab is None:
        raise ConfigError(f"{root} has no meta.json: set data.num_classes to the vocabulary's "
                          "size (GPT-2's: 50257)")
    return (TokenWindows(root / "train.bin", cfg.seq_len, cfg.batch_size, True, dtype),
            TokenWindows(root / "val.bin", cfg.seq_len, cfg.eval_batch_size, False, dtype,
                         max_batches=eval_max_batches),
            cfg.num_classes or vocab)


def load(cfg: TokensConfig, runtime: Runtime, options: Options) -> Loaded:
    """:func:`token_windows` as :data:`trainkit.data.sources.SOURCES` calls it."""
    return token_windows(cfg, eval_max_batches=options.eval_max_batches)


def _vocab_on_disk(root: Path) -> int | None:
    meta = root / "meta.json"
    return json.loads(meta.read_text()).get("vocab_size") if meta.is_file() else None


SOURCE = Source("tokens", TokensConfig, load, takes="tokens", classes_on_disk=_vocab_on_disk,
                reader_replaces=False)
