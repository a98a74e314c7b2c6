"""Mixtures' loaders (``data.mix``): each training sample drawn from one corpus by weight.

The draw is per sample (as MosaicML Streaming's and torchtitan's mixtures), so that every
batch holds the corpora about in proportion, and it is a function of ``(seed, epoch, place)``
alone: the same at any number of workers (the order is drawn in the main process), and a
resumed run continues the very mixture an uninterrupted one would.

- Token corpora (:class:`MixedTokenLoader`): batch ``b`` of a rank draws each window's corpus
  and offset from a generator seeded with ``(seed, epoch, rank, b)``, as
  :class:`~trainkit.data.loader.tokens.TokenLoader` draws its offsets.
- Map-style samples (:class:`MixtureSampler`, over :class:`MixtureSamples`): an epoch is
  ``sum(sizes)`` samples, ``round(weight * sum)`` of each corpus (its samples in a fresh
  random order, repeated when it has fewer), shuffled together by ``(seed, epoch)``; rank
  ``r`` takes every world-size-th of that one stream, as every map-style source's shard.
- Evaluation (:class:`EachSource`): each corpus's loader apart, ``parts`` by name.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from trainkit.core.errors import ConfigError
from trainkit.core.rng import mix_seed
from trainkit.data.loader.resumable import ResumableBatchSampler, ResumableLoader, SeededBatch
from trainkit.data.loader.tokens import TokenLoader


def apportion(weights: Sequence[float], total: int) -> list[int]:
    """``total`` split by ``weights`` into whole counts (largest remainders), summing to it."""
    shares = np.asarray(weights, dtype=np.float64) / float(sum(weights)) * total
    counts = np.floor(shares).astype(np.int64)
    for i in np.argsort(-(shares - counts), kind="stable")[:total - int(counts.sum())]:
        counts[i] += 1
    return counts.tolist()


def mixture_order(sizes: Sequence[int], weights: Sequence[float], *, seed: int,
                  epoch: int) -> torch.Tensor:
    """An epoch's stream of indices into the corpora laid end to end (corpus ``i``'s samples
    start at ``sum(sizes[:i])``): ``sum(sizes)`` samples, each corpus's share by weight."""
    generator = torch.Generator().manual_seed(mix_seed(seed, epoch))
    picks, start = [], 0
    for size, count in zip(sizes, apportion(weights, sum(sizes))):
        passes = [torch.randperm(size, generator=generator) for _ in range(-(-count // size))]
        if passes:
            picks.append(torch.cat(passes)[:count] + start)
        start += size
    stream = torch.cat(picks)
    return stream[torch.randperm(len(stream), generator=generator)]


class MixtureSamples(Dataset):
    """Map-style corpora laid end to end; a batch's indices fetched from each corpus at once."""

    def __init__(self, parts: Sequence[Dataset]) -> None:
        self.parts = list(parts)
        self.sizes = [len(part) for part in self.parts]  # type: ignore[arg-type]
        if 0 in self.sizes:
            raise ConfigError(f"data.mix: corpus {self.sizes.index(0)} has no samples")
        self.starts = np.cumsum([0, *self.sizes])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def locate(self, index: int) -> tuple[int, int]:
        """``(corpus, index within it)`` of a laid-end-to-end ``index``."""
        part = int(np.searchsorted(self.starts, index, side="right")) - 1
        return part, index - int(self.starts[part])

    def __getitem__(self, index: int) -> Any:
        part, inner = self.locate(index)
        return self.parts[part][inner]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        placed = [self.locate(i) for i in indices]
        out: list[Any] = [None] * len(placed)
        for part, dataset in enumerate(self.parts):
            rows = [row for row, (p, _) in enumerate(placed) if p == part]
            if not rows:
                continue
            inner = [placed[row][1] for row in rows]
            many = getattr(dataset, "__getitems__", None)
            for row, sample in zip(rows, many(inner) if many else [dataset[i] for i in inner]):
                out[row] = sample
        return out


class MixtureSampler(ResumableBatchSampler):
    """:class:`~trainkit.data.loader.order.ResumableBatchSampler` over a mixture's stream
    (:func:`mixture_order`) instead of a shuffled dataset: this rank's every world-size-th
    sample, in batches seeded by their place."""

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], batch_size: int, *,
                 drop_last: bool = False, seed: int = 0, rank: int = 0,
                 world_size: int = 1) -> None:
        super().__init__(sum(sizes), batch_size, shuffle=True, drop_last=drop_last, seed=seed,
                         rank=rank, world_size=world_size)
        self.sizes, self.weights = list(sizes), list(weights)

    def __iter__(self) -> Iterator[SeededBatch]:
        stream = mixture_order(self.sizes, self.weights, seed=self.seed, epoch=self.epoch)
        per_rank = len(stream) // self.world_size
        order = stream[:per_rank * self.world_size][self.rank::self.world_size].tolist()
        start, self.start = self.start, 0
        size = self.batch_size
        for b in range(start, self.num_batches):
            yield SeededBatch(mix_seed(self.seed, self.epoch, self.rank, b),
                              order[b * size:(b + 1) * size])


class MixedTokenLoader(ResumableLoader):
    """Batches ``{"tokens": int64 [batch, seq_len + 1]}`` whose every window comes from one of
    ``parts`` (training :class:`TokenLoader` s of one ``seq_len``), drawn by ``weights``.

    An epoch is as many batches as the corpora's windows together fill on each rank.
    """

    def __init__(self, parts: Sequence[TokenLoader], weights: Sequence[float], *,
                 seed: int = 0) -> None:
        first = parts[0]
        self.parts, self.seed = list(parts), seed
        self.seq_len, self.batch_size, self.device = first.seq_len, first.batch_size, first.device
        self.rank, self.world_size = first.rank, first.world_size
        self.tokens_per_sample = self.seq_len
        self._edges = torch.cumsum(torch.tensor(weights, dtype=torch.float64), 0)
        self._edges /= self._edges[-1].clone()
        self._highs = torch.tensor([len(p.tokens) - self.seq_len for p in parts])
        windows = sum((len(p.tokens) - 1) // self.seq_len for p in parts)
        self._batches = windows // (self.world_size * self.batch_size)
        self._span = np.arange(self.seq_len + 1)

    def __len__(self) -> int:
        return self._batches

    def draw(self, epoch: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``batch`` of ``epoch`` on this rank: each window's corpus and offset."""
        generator = torch.Generator().manual_seed(mix_seed(self.seed, epoch, self.rank, batch))
        u = torch.rand(self.batch_size, generator=generator, dtype=torch.float64)
        corpus = torch.searchsorted(self._edges, u, right=True).clamp_(max=len(self.parts) - 1)
        offsets = torch.rand(self.batch_size, generator=generator, dtype=torch.float64)
        return corpus, (offsets * self._highs[corpus]).long()

    def _pass(self, epoch: int, start: int) -> Iterator[dict[str, torch.Tensor]]:
        cuda = self.device.type == "cuda"
        for b in range(start, self._batches):
            corpus, offsets = self.draw(epoch, b)
            rows = np.empty((self.batch_size, self.seq_len + 1), dtype=np.int64)
            for part, loader in enumerate(self.parts):
                mine = (corpus == part).nonzero().flatten().numpy()
                if len(mine):  # one gather per corpus from its memory map
                    rows[mine] = loader.tokens[offsets.numpy()[mine, None] + self._span]
            tokens = torch.from_numpy(rows)
            if cuda:
                tokens = tokens.pin_memory().to(self.device, non_blocking=True)
            yield {"tokens": tokens}


class EachSource:
    """A mixture's evaluation: each corpus's loader by name (``parts``), evaluated apart
    (``val/loss/<name>``); iterated whole, its parts one after another."""

    def __init__(self, parts: Mapping[str, Any]) -> None:
        self.parts = dict(parts)

    def __len__(self) -> int:
        return sum(len(part) for part in self.parts.values())

    def __iter__(self) -> Iterator[Any]:
        for part in self.parts.values():
            yield from part
