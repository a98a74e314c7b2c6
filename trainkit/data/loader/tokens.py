"""The token-window loader: ``data=tokens``'s batches from a memory-mapped token file.

Training: an epoch is ``(tokens - 1) // seq_len // (world_size * batch_size)`` batches per
rank; batch ``b`` is ``batch_size`` windows of ``seq_len + 1`` tokens at offsets drawn from a
generator seeded with ``(seed, epoch, rank, b)``, so a resumed run reads the very windows an
uninterrupted one would. Evaluation: the windows end to end (window ``i`` at ``i * seq_len``),
rank ``r`` taking every world-size-th; with ``max_batches`` that many batches of windows spread
evenly over the file, the same at every evaluation.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from trainkit.core.errors import ConfigError
from trainkit.core.rng import mix_seed
from trainkit.data.loader.resumable import ResumableLoader, epoch_order

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
