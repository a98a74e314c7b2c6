"""``data=tokens``: windows of a token corpus read through a memory map (nanoGPT's format).

A corpus is a folder of ``train.bin`` and ``val.bin`` (flat uint16 or uint32 token ids) and
optionally ``meta.json`` (``python -m trainkit.data tokenize`` writes all three); a URL is
fetched once into a local cache (:mod:`trainkit.data.remote`). Nothing is read whole.

Training: an epoch is ``(tokens - 1) // seq_len // (world_size * batch_size)`` batches per
rank; batch ``b`` is ``batch_size`` windows of ``seq_len + 1`` tokens at offsets drawn from a
generator seeded with ``(seed, epoch, rank, b)``, so a resumed run reads the very windows an
uninterrupted one would. Evaluation: the windows end to end (window ``i`` at ``i * seq_len``),
rank ``r`` taking every world-size-th; with ``max_batches`` that many batches of windows spread
evenly over the file, the same at every evaluation.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainkit.config import TokensConfig
from trainkit.core.errors import ConfigError
from trainkit.core.location import fetched
from trainkit.core.rng import mix_seed
from trainkit.core.runtime import Runtime
from trainkit.data.loader.order import epoch_order
from trainkit.data.loader.resumable import ResumableLoader
from trainkit.data.remote import fetch_files
from trainkit.data.sources.source import Options, Source

DTYPES = ("uint16", "uint32")


class TokenLoader(ResumableLoader):
    """Batches ``{"tokens": int64 [batch, seq_len + 1]}`` from a memory-mapped token file.

    A :class:`~trainkit.data.ResumableData`: ``set_epoch(epoch, start_batch)`` points it
    anywhere; ``len()`` is the epoch's batch count. See the module's docstring for the order.

    Args:
        path: the token file (``train.bin``).
        seq_len: tokens of context per window (each window has one more: the last target).
        batch_size: windows per batch on this rank.
        shuffle: random windows fixed by ``(seed, epoch, rank, batch)`` (training), or the
            file's windows end to end, in order (evaluation).
        dtype: ``uint16`` or ``uint32``, as the file was written.
        device: where batches go (pinned and copied asynchronously when it is CUDA).
        seed, rank, world_size: the run's seed and this process's place among the ranks.
        max_batches: evaluation (``shuffle=False``) only: at most this many batches per rank,
            of windows spread evenly over the file; None: every window.
    """

    def __init__(self, path: str | Path, seq_len: int, batch_size: int, *, shuffle: bool,
                 dtype: str = "uint16", device: torch.device | str = "cpu", seed: int = 0,
                 rank: int = 0, world_size: int = 1, max_batches: int | None = None) -> None:
        path = Path(path)
        if dtype not in DTYPES:
            raise ConfigError(f"token dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        if not path.is_file():
            raise ConfigError(f"{path} does not exist: write it with `python -m trainkit.data "
                              "tokenize <text files or folder> <folder>` and set data.root")
        size, item = path.stat().st_size, np.dtype(dtype).itemsize
        if size % item:
            raise ConfigError(f"{path} is {size} bytes, not a whole number of {dtype} tokens: "
                              "is it a token file, and of this dtype (data.token_dtype)?")
        self.tokens = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
        self.path, self.seq_len, self.batch_size, self.shuffle = path, seq_len, batch_size, shuffle
        self.device, self.seed = torch.device(device), seed
        self.rank, self.world_size = rank, world_size
        self.tokens_per_sample = seq_len  # the tokens a window trains on: tokens/s in the log
        windows = max(0, (len(self.tokens) - 1) // seq_len)
        if shuffle and max_batches:
            raise ConfigError("max_batches bounds an evaluation loader (shuffle=False) only")
        sample = max_batches * batch_size * world_size if max_batches else None
        self._order = None if shuffle else epoch_order(
            windows, seed=seed, epoch=0, shuffle=False, rank=rank, world_size=world_size,
            sample=sample).numpy()
        self._batches = (windows // (world_size * batch_size) if shuffle
                         else -(-len(self._order) // batch_size))
        if self._batches == 0:
            raise ConfigError(
                f"{path} has {len(self.tokens)} tokens: not one batch of {batch_size} windows of "
                f"{seq_len + 1} for each of {world_size} rank(s); lower data.batch_size or "
                "data.seq_len, or give a larger corpus")
        self._span = np.arange(seq_len + 1)

    def __len__(self) -> int:
        return self._batches

    def offsets(self, epoch: int, batch: int) -> np.ndarray:
        """Where batch ``batch`` of ``epoch``'s windows start on this rank."""
        if not self.shuffle:
            return self._order[batch * self.batch_size:(batch + 1) * self.batch_size] * self.seq_len
        generator = torch.Generator().manual_seed(mix_seed(self.seed, epoch, self.rank, batch))
        high = len(self.tokens) - self.seq_len  # the last window ends at the file's last token
        return torch.randint(high, (self.batch_size,), generator=generator).numpy()

    def _pass(self, epoch: int, start: int) -> Iterator[dict[str, torch.Tensor]]:
        cuda = self.device.type == "cuda"
        for b in range(start, self._batches):
            # one gather from the memory map: only these windows' pages are read
            rows = self.tokens[self.offsets(epoch, b)[:, None] + self._span]
            tokens = torch.from_numpy(rows.astype(np.int64))
            if cuda:
                tokens = tokens.pin_memory().to(self.device, non_blocking=True)
            yield {"tokens": tokens}


def corpus_meta(root: Path) -> dict[str, Any]:
    """``meta.json`` beside the token files, or ``{}`` when there is none (nanoGPT's own)."""
    meta = root / "meta.json"
    return json.loads(meta.read_text()) if meta.is_file() else {}


def token_loaders(cfg: TokensConfig, runtime: Runtime, *, seed: int = 0,
                  eval_max_batches: int | None = None) -> tuple[TokenLoader, TokenLoader, int]:
    """Training and evaluation loaders over ``<data.root>/train.bin`` and ``val.bin``, and the
    vocabulary's size: ``data.num_classes`` when set (at least meta.json's: a model may have
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
    common = {"seq_len": cfg.seq_len, "dtype": dtype, "device": runtime.device, "seed": seed,
              "rank": runtime.rank, "world_size": runtime.world_size}
    return (TokenLoader(root / "train.bin", batch_size=cfg.batch_size, shuffle=True, **common),
            TokenLoader(root / "val.bin", batch_size=cfg.eval_batch_size, shuffle=False,
                        max_batches=eval_max_batches, **common),
            cfg.num_classes or vocab)


def load(cfg: TokensConfig, runtime: Runtime, options: Options) -> tuple[Any, Any, int]:
    """:func:`token_loaders` as :data:`trainkit.data.sources.SOURCES` calls it."""
    return token_loaders(cfg, runtime, seed=options.seed,
                         eval_max_batches=options.eval_max_batches)


def _vocab_on_disk(root: Path) -> int | None:
    meta = root / "meta.json"
    return json.loads(meta.read_text()).get("vocab_size") if meta.is_file() else None


SOURCE = Source("tokens", TokensConfig, load, takes="tokens", classes_on_disk=_vocab_on_disk,
                reader_replaces=False)
