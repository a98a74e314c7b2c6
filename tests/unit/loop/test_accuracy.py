"""trainkit.loop.accuracy.Accuracy: top-1 accuracy as torchmetrics computes it."""

from __future__ import annotations

import pytest
import torch
from torchmetrics.classification import MulticlassAccuracy

from trainkit.loop.accuracy import Accuracy


def test_equals_torchmetrics_micro_accuracy_over_batches() -> None:
    gen = torch.Generator().manual_seed(0)
    ours, theirs = Accuracy(), MulticlassAccuracy(10, average="micro")
    for n in (7, 64, 1):
        logits = torch.randn(n, 10, generator=gen)
        targets = torch.randint(0, 10, (n,), generator=gen)
        logits[: n // 2, 3] += 5  # some right, some wrong
        ours.update(logits, targets)
        theirs.update(logits, targets)
    assert float(ours.compute()) == pytest.approx(float(theirs.compute()), abs=1e-7)
    assert 0 < float(ours.compute()) < 1


def test_reset_and_empty() -> None:
    acc = Accuracy().to("cpu")
    acc.update(torch.tensor([[0.0, 1.0]]), torch.tensor([1]))
    assert float(acc.compute()) == 1.0
    acc.reset()
    assert float(acc.compute()) == 0.0


def test_wrong_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"logits \[N, classes\]"):
        Accuracy().update(torch.zeros(4), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"logits \[N, 10\]"):
        Accuracy(10).update(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))
