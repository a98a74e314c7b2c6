"""trainkit.data.mixing: MixUp / CutMix soft targets the loss takes, drawn by batch position."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from trainkit.data.mixing import MixedBatches, batch_mixing


class Batches:
    """A loader of 6 fixed (images, labels) batches an epoch that serves a pass from a
    position its caller holds, as trainkit's loaders do."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.items = [(torch.randn(4, 3, 8, 8, generator=gen), torch.arange(4) % 3)
                      for _ in range(6)]

    def __len__(self) -> int:
        return len(self.items)

    def batches(self, epoch: int, start: int = 0) -> Iterator[Any]:
        return iter(self.items[start:])

    def state_dict(self) -> dict[str, Any]:
        return {"seed": 0}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        assert state == {"seed": 0}


def __iter__(self) -> Iterator[Any]:
        yield from self.batches[self.start:]
        self.start = 0


def test_soft_targets_sum_to_one_and_the_loss_takes_them() -> None:
    for mix in (batch_mixing(3, mixup=0.8), batch_mixing(3, cutmix=1.0),
                batch_mixing(3, mixup=0.8, cutmix=1.0)):
        images, labels = MixedBatches(Batches(), mix, seed=0).mixed(Batches().items[0], 0, 0)
        assert images.shape == (4, 3, 8, 8) and labels.shape == (4, 3)
        assert torch.allclose(labels.sum(1), torch.ones(4))
        assert not torch.equal(images, Batches().items[0][0])  # mixed
        logits = torch.randn(4, 3, requires_grad=True)
        F.cross_entropy(logits, labels, label_smoothing=0.1).backward()
        assert torch.isfinite(logits.grad).all()


def test_off_is_none() -> None:
    assert batch_mixing(3) is None


def test_a_resumed_pass_mixes_as_the_uninterrupted_one() -> None:
    mix = batch_mixing(3, mixup=0.8, cutmix=1.0)
    straight = MixedBatches(Batches(), mix, seed=7)
    straight.set_epoch(1)
    whole = list(straight)
    torch.manual_seed(123)  # the global generator: neither used nor moved by the mixing
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    resumed = MixedBatches(Batches(), mix, seed=7)
    resumed.load_state_dict(straight.state_dict())
    rest = list(resumed.batches(1, 2))  # as the fit asks, from the position it holds
    assert torch.equal(torch.rand(3), expected_next)
    assert len(rest) == 4
    for (a, la), (b, lb) in zip(whole[2:], rest):
        assert torch.equal(a, b) and torch.equal(la, lb)
    other = MixedBatches(Batches(), mix, seed=8)
    other.set_epoch(1)
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(whole, other))  # the seed counts
    assert len(straight) == 6 and straight.state_dict() == {"seed": 0}
