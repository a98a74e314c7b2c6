"""The device prefetcher: the same batches as without it, normalised, on CPU and CUDA; its side
stream's ordering on a GPU, and a CPU stand-in of the same structure."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from trainkit.data import DevicePrefetcher, make_loader
from trainkit.data.batches import ImageBatch


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
    assert prefetcher.state_dict() == {}  # no position here: the caller holds it


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


# -- the side stream's two guarantees --------------------------------------------------------
# ``wait_stream``: the compute stream reads a batch only after the side stream's copy and
# normalisation of it; ``record_stream``: a batch's memory is not handed to a later copy while
# the compute stream may still read it. The GPU test makes each hazard show: the side stream is
# slowed before every copy (a queued matmul loop), the compute stream before every read, the
# checks run on the device, and each batch is dropped while its reads are still queued. The CPU
# stand-in runs the prefetcher's own CUDA path over fake streams that record what is queued where.

N_BATCHES = 6


def _busy(stream: torch.cuda.Stream, work: torch.Tensor, out: torch.Tensor, n: int) -> None:
    """Queue ``n`` matmuls on ``stream`` (public torch: a queued delay of the GPU, not the host)."""
    with torch.cuda.stream(stream):
        for _ in range(n):
            torch.matmul(work, work, out=out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("image_batch", [False, True], ids=["tuples", "image_batches"])
@pytest.mark.parametrize(("side_work", "compute_work"), [
    (60, 0),  # the side stream lags: without wait_stream a batch is read before it is written
    (5, 60),  # the compute stream lags: without record_stream a later copy takes its memory
], ids=["side_lags", "compute_lags"])
def test_cuda_batches_are_ready_when_handed_out_and_not_reused_while_read(
        side_work: int, compute_work: int, image_batch: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinned uint8 batches normalised on the side stream, a queued delay on the side stream
    before each copy and on the compute stream before each read, checks on the device, and
    each batch dropped while its reads are still queued: one host read, at the end.
    ``image_batches``: the image loader's ``ImageBatch``, whose two tensors the prefetcher
    copies itself (``_copy``: non_blocking from pinned memory), not through move_to_device."""
    made: list[torch.cuda.Stream] = []
    real_stream = torch.cuda.Stream

    def stream(*args: object, **kwargs: object) -> torch.cuda.Stream:
        made.append(real_stream(*args, **kwargs))  # the prefetcher's side stream
        return made[-1]

    monkeypatch.setattr(torch.cuda, "Stream", stream)
    mean, std = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
    values = [10 * (i + 1) for i in range(N_BATCHES)]  # each batch its own, none zero
    batches = [(torch.full((64, 3, 64, 64), v, dtype=torch.uint8).pin_memory(),
                torch.full((64,), i).pin_memory()) for i, v in enumerate(values)]
    expected = [((v / 255 - torch.tensor(mean)) / torch.tensor(std)).view(1, 3, 1, 1).cuda()
                for v in values]
    work = torch.randn(2048, 2048, device="cuda")
    side_out, compute_out = torch.empty_like(work), torch.empty_like(work)
    torch.cuda.synchronize()

    def slowed() -> Iterator[Any]:
        for batch in batches:
            _busy(made[0], work, side_out, side_work)  # queued before this batch's copy
            yield ImageBatch(*batch, [], []) if image_batch else batch

    prefetcher = DevicePrefetcher(slowed(), "cuda", mean=mean, std=std)
    assert len(made) == 1
    worst = torch.zeros((), device="cuda")
    wrong_labels = torch.zeros((), dtype=torch.long, device="cuda")
    compute = torch.cuda.current_stream()
    for i, (x, y) in enumerate(prefetcher):
        _busy(compute, work, compute_out, compute_work)  # the reads below wait behind this
        worst = torch.maximum(worst, (x - expected[i]).abs().amax())
        wrong_labels += (y != i).sum()
        del x, y  # dropped while its reads are still queued
    assert i == N_BATCHES - 1
    assert worst.item() < 1e-5 and wrong_labels.item() == 0  # the one host read, at the end


class _FakeStream:
    """A stream that records the work queued on it, and the waits on other streams."""

    def __init__(self, name: str, log: list[tuple]) -> None:
        self.name, self.log, self.queued = name, log, 0
        self.waited_for: dict[str, int] = {}  # other stream -> its work queued at the wait

    def wait_stream(self, other: _FakeStream) -> None:
        self.waited_for[other.name] = other.queued
        self.log.append(("wait", self.name, other.name))


def _stand_in(module: types.ModuleType, monkeypatch: pytest.MonkeyPatch,
              image_batches: bool = False) -> list[str]:
    """Run ``module``'s DevicePrefetcher down its CUDA path on the CPU, over fake streams; the
    hazards it leaves, one line each (none when the prefetcher waits and records).
    ``image_batches``: ``ImageBatch``es, whose tensors the prefetcher's ``_copy`` moves."""
    log: list[tuple] = []
    side, compute = _FakeStream("side", log), _FakeStream("compute", log)
    active = [compute]
    copied: dict[int, int] = {}  # batch -> its copy's place in the side stream's work
    recorded: list[tuple[torch.Tensor, str]] = []  # kept alive: no id is reused meanwhile

    @contextlib.contextmanager
    def on(stream: _FakeStream) -> Iterator[None]:
        active.append(stream)
        try:
            yield
        finally:
            active.pop()

    def move(batch: Any, device: object) -> Any:
        stream = active[-1]
        stream.queued += 1  # the copy, queued on whichever stream is current
        copied[int(batch[1][0])] = stream.queued
        return batch[0].clone(), batch[1].clone()

    def copy(x: torch.Tensor) -> torch.Tensor:  # one tensor of an ImageBatch
        stream = active[-1]
        stream.queued += 1
        if x.dtype != torch.uint8:  # the labels, copied after the images
            copied[int(x[0])] = stream.queued
        return x.clone()

    def record_stream(tensor: torch.Tensor, stream: _FakeStream) -> None:
        recorded.append((tensor, stream.name))

    made = [(torch.full((2, 3, 2, 2), i, dtype=torch.uint8), torch.full((2,), i))
            for i in range(N_BATCHES)]
    prefetcher = module.DevicePrefetcher(
        [ImageBatch(*b, [], []) for b in made] if image_batches else made, "cpu")
    monkeypatch.setattr(prefetcher, "_stream", side)
    monkeypatch.setattr(prefetcher, "_copy", copy)
    monkeypatch.setattr(module, "move_to_device", move)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    hazards = []
    for x, y in prefetcher:  # the consumer reads x and y on the compute stream
        batch = int(y[0])
        if compute.waited_for.get("side", 0) < copied[batch]:
            hazards.append(f"batch {batch} read before its copy on the side stream ended")
        for tensor in (x, y):
            if not any(t is tensor and name == "compute" for t, name in recorded):
                hazards.append(f"batch {batch}'s memory not kept for the compute stream's reads")
    copies = N_BATCHES * (2 if image_batches else 1)  # an ImageBatch: images, then labels
    assert sorted(copied) == list(range(N_BATCHES)) and side.queued == copies  # all on side
    return sorted(set(hazards))


def _without(line_part: str) -> types.ModuleType:
    """The prefetcher's module with every statement holding ``line_part`` made a ``pass``."""
    import importlib

    module = importlib.import_module(DevicePrefetcher.__module__)
    source = Path(module.__file__).read_text()
    kept = [line[:len(line) - len(line.lstrip())] + "pass" if line_part in line else line
            for line in source.splitlines()]
    assert kept != source.splitlines(), f"the prefetcher has no {line_part}"
    mutant = types.ModuleType(f"{module.__name__}_without")
    mutant.__file__ = module.__file__
    exec(compile("\n".join(kept), module.__file__, "exec"), mutant.__dict__)
    return mutant


@pytest.mark.parametrize("image_batches", [False, True], ids=["tuples", "image_batches"])
def test_the_cpu_stand_in_holds_for_the_prefetcher(image_batches: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    assert _stand_in(importlib.import_module(DevicePrefetcher.__module__), monkeypatch,
                     image_batches) == []


@pytest.mark.parametrize("image_batches", [False, True], ids=["tuples", "image_batches"])
@pytest.mark.parametrize(("removed", "hazard"), [
    (".wait_stream(", "read before its copy on the side stream ended"),
    (".record_stream(", "memory not kept for the compute stream's reads"),
])
def test_the_cpu_stand_in_fails_without_wait_stream_or_record_stream(
        removed: str, hazard: str, image_batches: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The structure the GPU test checks, shown to catch each line's removal."""
    hazards = _stand_in(_without(removed), monkeypatch, image_batches)
    assert hazards and all(hazard in line for line in hazards), hazards


def test_the_batch_read_ahead_is_not_counted_as_handed_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Down the CUDA path (fake streams on the CPU) the prefetcher holds the next batch while
    the caller has the current one; the loader's position counts what was handed out, and a
    resume from it serves the very next batch: the look-ahead is no position of its own."""
    import importlib

    module = importlib.import_module(DevicePrefetcher.__module__)
    side = _FakeStream("side", [])

    def prefetcher() -> DevicePrefetcher:
        made = module.DevicePrefetcher(_loader(), "cpu")
        monkeypatch.setattr(made, "_stream", side)
        return made

    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: side)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: None)
    whole = [y for _, y in prefetcher()]
    first = prefetcher()
    first.set_epoch(0)
    taken = []
    for _, y in first:
        taken.append(y)
        if len(taken) == 2:
            break
    again = prefetcher()  # the caller holds the position: 2 taken (the third read ahead)
    again.load_state_dict(first.state_dict())
    rest = [y for _, y in again.batches(0, len(taken))]
    assert all(torch.equal(a, b) for a, b in zip(taken + rest, whole, strict=True))
