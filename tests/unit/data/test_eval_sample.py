"""trainer.eval_max_batches: a fixed sample spread evenly over the split, not its first batches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from trainkit.config import DataConfig
from trainkit.core.runtime import Runtime
from trainkit.data import InMemoryLoader, build_loaders, make_loader
from trainkit.data.loader.resumable import evaluation_sample
from trainkit.data.sources.tensors import TensorData
from trainkit.loop.evaluation import evaluate
from trainkit.loop.precision import Precision
from trainkit.models.gpt import lm_forward, lm_loss

CPU = Runtime(torch.device("cpu"))
VOCAB = 64


class Unigram(nn.Module):
    """Next-token logits from the training file's token frequencies, whatever the context."""

    def __init__(self, tokens: np.ndarray) -> None:
        super().__init__()
        counts = np.bincount(tokens, minlength=VOCAB) + 1
        self.logits = nn.Parameter(torch.tensor(np.log(counts / counts.sum()), dtype=torch.float32))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(*tokens.shape, VOCAB)


def _halves(n: int, rng: np.random.Generator) -> np.ndarray:
    """A corpus whose first half uses 4 tokens and whose second half uses all 64."""
    return np.concatenate([rng.integers(0, 4, n // 2), rng.integers(0, VOCAB, n - n // 2)]
                          ).astype(np.uint16)


def test_a_bounded_evaluation_of_a_corpus_whose_halves_differ_is_within_5pct_of_the_full(
        tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    train = _halves(16 * 200, rng)
    train.tofile(tmp_path / "train.bin")
    _halves(16 * 400 + 1, rng).tofile(tmp_path / "val.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": VOCAB, "dtype": "uint16"}))
    cfg = DataConfig(name="tokens", root=str(tmp_path), seq_len=16, batch_size=4,
                     eval_batch_size=4)
    model = Unigram(train.astype(np.int64))

    def loss(data: object, max_batches: int | None = None) -> float:
        return evaluate(model, data, precision=Precision("32", "cpu"), device=CPU.device,
                        criterion=lm_loss, metrics={}, forward=lm_forward,
                        max_batches=max_batches)["val/loss"]

    full = loss(build_loaders(cfg, CPU)[1])
    first = loss(build_loaders(cfg, CPU)[1], max_batches=5)  # the first 20 windows: 4 tokens
    bounded_data = build_loaders(cfg, CPU, eval_max_batches=5)[1]
    assert len(bounded_data) == 5
    bounded = loss(bounded_data, max_batches=5)
    assert abs(first - full) / full > 0.3  # the corpus shows a first-batches estimate's bias
    assert abs(bounded - full) / full < 0.05, (bounded, full)
    assert loss(bounded_data, max_batches=5) == bounded  # the same sample at every evaluation


def test_the_sample_is_spread_over_a_split_stored_class_after_class_and_shared_by_ranks(
) -> None:
    labels = torch.arange(4).repeat_interleave(25)  # 4 classes of 25, one after the other
    data = TensorData(torch.zeros(100, 1, 2, 2, dtype=torch.uint8), labels, (0.5,), (0.5,), 4)
    sample = evaluation_sample(100, 8)
    assert sample.tolist() == [6, 18, 31, 43, 56, 68, 81, 93]
    memory = InMemoryLoader(data, 4, shuffle=False, max_batches=2)
    assert [y.tolist() for _, y in memory] == [[0, 0, 1, 1], [2, 2, 3, 3]]
    seen = []
    for rank in (0, 1):  # each rank its share of the same sample: max_batches batches each
        loader = make_loader(torch.utils.data.TensorDataset(labels), 2, shuffle=False, seed=3,
                             rank=rank, world_size=2, num_workers=0, max_batches=2)
        batches = [batch[0].tolist() for batch in loader]
        assert len(loader) == len(batches) == 2
        seen += [index for batch in batches for index in batch]
    assert sorted(seen) == labels[sample].tolist()
    with pytest.raises(Exception, match="evaluation loaders"):
        make_loader(torch.utils.data.TensorDataset(labels), 2, shuffle=True, num_workers=0,
                    max_batches=2)
