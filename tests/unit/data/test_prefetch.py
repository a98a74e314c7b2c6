"""The device prefetcher: the same batches as without it, normalised, on CPU and CUDA."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from trainkit.data import DevicePrefetcher, make_loader


def _loader(pin: bool | None = None) -> object:
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (40, 3, 4, 4), dtype=torch.uint8, generator=g)
    return make_loader(TensorDataset(images, torch.arange(40)), 8, shuffle=True, seed=1,
                       num_workers=0, pin_memory=pin)


def _expected(loader: object, mean: torch.Tensor, std: torch.Tensor) -> list[tuple]:
    return [((x.float() / 255 - mean) / std, y) for x, y in loader]


def _check(device: str) -> None:
    mean, std = torch.tensor([0.5, 0.4, 0.3]), torch.tensor([0.2, 0.25, 0.3])
    loader = _loader(pin=device.startswith("cuda"))
    loader.set_epoch(2)
    expected = _expected(loader, mean.view(1, 3, 1, 1), std.view(1, 3, 1, 1))
    prefetcher = DevicePrefetcher(loader, device, mean=mean.tolist(), std=std.tolist(),
                                  channels_last=True)
    assert len(prefetcher) == len(loader) == 5 and prefetcher.batch_size == 8
    prefetcher.set_epoch(2)
    got = list(prefetcher)
    assert len(got) == len(expected)
    for (x, y), (ex, ey) in zip(got, expected):
        assert x.device.type == torch.device(device).type
        assert x.is_contiguous(memory_format=torch.channels_last)
        assert torch.allclose(x.cpu(), ex, atol=1e-6) and torch.equal(y.cpu(), ey)
    prefetcher.set_epoch(2, start_batch=3)  # resume protocol passes through
    rest = list(prefetcher)
    assert len(rest) == 2 and torch.equal(rest[0][1].cpu(), expected[3][1])
    assert prefetcher.state_dict() == {"epoch": 2, "batch": 5}


def test_cpu_pass_through_normalises() -> None:
    _check("cpu")


def test_cpu_without_statistics_only_rescales_uint8() -> None:
    batches = [(torch.full((2, 1, 2, 2), 255, dtype=torch.uint8), torch.zeros(2)),
               (torch.ones(2, 1, 2, 2), torch.ones(2))]
    got = list(DevicePrefetcher(batches, "cpu"))
    assert torch.equal(got[0][0], torch.ones(2, 1, 2, 2))
    assert got[1][0] is batches[1][0]  # float inputs, no statistics: untouched


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_side_stream_gives_the_same_batches() -> None:
    _check("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batches_are_ready_when_handed_out_and_not_reused_while_read() -> None:
    """Each batch is dropped before the next is taken, and the consumer's stream is slowed before
    it reads: without ``wait_stream`` a batch would be read before its copy ends, without
    ``record_stream`` its memory could be handed to the next copy while still being read."""
    batches = [(torch.full((64, 3, 32, 32), float(i)), torch.full((64,), i)) for i in range(6)]
    for i, (x, y) in enumerate(DevicePrefetcher(batches, "cuda")):
        torch.cuda._sleep(50_000_000)  # the consumer lags: the next copy runs meanwhile
        assert torch.equal(x, torch.full_like(x, float(i))) and torch.equal(y.cpu(), batches[i][1])
        del x, y
