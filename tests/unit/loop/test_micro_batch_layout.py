"""micro_batch_size=auto's gradient buckets (DDP's all-reduce done by hand) keep each gradient
in its weight's memory layout: a channels_last conv weight gets a channels_last gradient, and a
fused AdamW step equals the one on the unbucketed gradients (was: a contiguous gradient, and a
step off by 2 x lr on the CPU)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from trainkit.loop.micro_batch import average_buckets, bucket_gradients


def _conv_with_gradients() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 8, 3), nn.Flatten(), nn.Linear(8 * 4 * 4, 3))
    model = model.to(memory_format=torch.channels_last)
    x = torch.randn(2, 4, 6, 6).to(memory_format=torch.channels_last)
    model(x).square().sum().backward()
    return model


def _fused_step(model: nn.Module) -> list[torch.Tensor]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture
def one_rank() -> Iterator[None]:
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if started:
        dist.destroy_process_group()


def test_a_bucketed_gradient_keeps_the_weights_layout_and_a_fused_step_is_unchanged(
        one_rank: None) -> None:
    plain, bucketed = _conv_with_gradients(), _conv_with_gradients()
    weight = bucketed[0].weight
    assert weight.is_contiguous(memory_format=torch.channels_last)
    grads = [p.grad.clone() for p in bucketed.parameters()]
    buckets = bucket_gradients(bucketed.parameters())
    average_buckets(buckets)  # one rank: divided by 1
    for param, grad in zip(bucketed.parameters(), grads):
        assert param.grad.stride() == param.stride(), param.shape
        assert torch.equal(param.grad, grad)
        assert param.grad.untyped_storage().data_ptr() == buckets[0].flat.untyped_storage(
            ).data_ptr()  # still a view of its bucket
    assert all(torch.equal(a, b) for a, b in zip(_fused_step(plain), _fused_step(bucketed)))


def test_a_gradient_another_rank_had_is_given_in_the_weights_layout(one_rank: None) -> None:
    """A parameter this rank did not use: its average comes from the bucket, in its layout."""
    model = _conv_with_gradients()
    weight = model[0].weight
    expected = weight.grad.clone()
    (bucket,) = bucket_gradients(model.parameters())
    weight.grad = None  # as if unused here; its flag as if another rank had it
    index = [p is weight for p in bucket.params].index(True)
    bucket.flat[bucket.flat.numel() - len(bucket.params) + index] = 1
    average_buckets([bucket])
    assert weight.grad.stride() == weight.stride() and torch.equal(weight.grad, expected)
