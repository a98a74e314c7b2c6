"""FLOPs under FSDP with mixed precision: fully_shard's pre-hook casts the inputs to bf16/fp16
before the model runs; the meter's hook comes first, so the float32 meta copy gets the inputs as
the step gave them and counts (was: "Input type (c10::BFloat16) and bias type (float) should be
the same", no FLOPs, no MFU)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from trainkit.distributed.fsdp import mixed_precision
from trainkit.observe.flops import FlopsMeter

CPU = torch.device("cpu")


@pytest.fixture
def one_rank() -> Iterator[None]:
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if started:
        dist.destroy_process_group()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_fsdp_with_mixed_precision_counts_the_same_flops(precision: str, one_rank: None,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    from torch.distributed.fsdp import fully_shard

    x = torch.randn(5, 3, 8, 8)
    plain = _net()
    reference = FlopsMeter(plain, CPU, "32", peak_tflops=1.0).watch(plain)
    plain(x)

    model = _net()
    meter = FlopsMeter(model, CPU, precision, peak_tflops=1.0)  # copied before sharding
    sharded = fully_shard(model, mp_policy=mixed_precision(precision))
    meter.watch(sharded)
    with caplog.at_level("INFO", logger="trainkit"):
        out = sharded(x)
    assert out.dtype != torch.float32  # fully_shard's cast ran
    assert "FLOPs not counted" not in caplog.text
    assert meter.per_sample is not None and meter.per_sample == reference.per_sample
    assert meter.window(10, 1.0)["throughput/mfu"] > 0
