"""``data.pack=true``: a causal LM's documents packed into ``data.seq_len`` windows.

A split's texts are tokenised once at load (each cut to ``seq_len - 1`` tokens, then an end-of-text
token), and placed whole into windows by a best-fit-decreasing pass: the same fixed list of
windows from the same split, so each window is an index of a map-style dataset and shuffling,
sharding and a mid-epoch resume are the loader's as for every source.

A window's batch is ``{"input_ids", "position_ids", "labels"}`` without an ``attention_mask``:
the position ids restart at 0 at each document, from which transformers' attention masks
(``masking_utils``, SDPA and eager) keep each token's attention inside its own document; the
first token of each document is labelled -100, so no loss crosses a boundary (as
``DataCollatorWithFlattening`` does). The padding after a window's last document continues its
positions and is labelled -100: it is attended by nothing real and predicts nothing.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from trainkit.core.errors import ConfigError

IGNORE = -100  # transformers' and torch's ignored label
TOKENIZE_CHUNK = 1024  # texts per tokenizer call at load


def best_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of at most ``capacity``: the longest first, each
    into the fullest bin it fits (ties: the earliest), the bins in the order they were opened;
    deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin index), sorted
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"a document of {n} tokens is longer than a window ({capacity})")
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            room, b = free.pop(at)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, b))
    return bins


class PackedWindows(Dataset):
    """A split's texts as packed windows of at most ``seq_len`` tokens (:func:`best_fit`)."""

    def __init__(self, texts: Sequence[str], tokenizer: Any, *, seq_len: int) -> None:
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ConfigError("data.pack=true puts an end-of-text token after each document: "
                              "the tokenizer has none (set tokenizer.eos_token and save it)")
        if seq_len < 2:
            raise ConfigError(f"data.pack=true needs data.seq_len >= 2, got {seq_len}")
        docs: list[list[int]] = []
        for start in range(0, len(texts), TOKENIZE_CHUNK):
            encoded = tokenizer(list(texts[start:start + TOKENIZE_CHUNK]), truncation=True,
                                max_length=seq_len - 1)["input_ids"]
            docs.extend([*ids, eos] for ids in encoded)
        lengths = [len(d) for d in docs]
        self.tokens = torch.tensor([t for d in docs for t in d], dtype=torch.long)
        self.offsets = torch.tensor([0, *lengths], dtype=torch.long).cumsum(0).tolist()
        self.windows = best_fit(lengths, seq_len)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        parts = [(self.offsets[d], self.offsets[d + 1]) for d in self.windows[i]]
        ids = torch.cat([self.tokens[a:b] for a, b in parts])
        positions = torch.cat([torch.arange(b - a) for a, b in parts])
        labels = ids.clone()
        starts = torch.tensor([0, *[b - a for a, b in parts[:-1]]]).cumsum(0)
        labels[starts] = IGNORE  # a document's first token: not predicted from the one before
        return {"input_ids": ids, "position_ids": positions, "labels": labels}

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        return [self[i] for i in indices]

    def real_tokens(self) -> int:
        """The split's tokens, end-of-text tokens included."""
        return len(self.tokens)


class PackBatch:
    """Windows -> one batch padded to its longest window: ``input_ids`` (``pad``),
    ``position_ids`` (continuing the last document's) and ``labels`` (-100)."""

    def __init__(self, pad: int) -> None:
        self.pad = pad

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), longest), self.pad, dtype=torch.long)
        labels = torch.full((len(samples), longest), IGNORE, dtype=torch.long)
        positions = torch.empty((len(samples), longest), dtype=torch.long)
        for row, sample in enumerate(samples):
            n = len(sample["input_ids"])
            ids[row, :n], labels[row, :n] = sample["input_ids"], sample["labels"]
            positions[row, :n] = sample["position_ids"]
            last = int(sample["position_ids"][-1])
            positions[row, n:] = torch.arange(last + 1, last + 1 + longest - n)
        return {"input_ids": ids, "position_ids": positions, "labels": labels}


def real_tokens(batch: Any) -> torch.Tensor | None:
    """The real (not padding) tokens of a Hugging Face text batch, counted on its device (no
    host read): its ``attention_mask``'s ones, or, packed, the labelled tokens plus each
    document's first (position 0); None for any other batch."""
    if not isinstance(batch, dict) or "input_ids" not in batch:
        return None
    if "attention_mask" in batch:
        return batch["attention_mask"].sum()
    if "position_ids" in batch and "labels" in batch:
        return (batch["labels"] != IGNORE).sum() + (batch["position_ids"] == 0).sum()
    return None
