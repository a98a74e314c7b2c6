"""A counted window's all-reduce (token-normalised loss under DDP/FSDP): started asynchronously
before the first backward, waited at the first ``optimize``, and on CUDA waited by the compute
stream, not the host (NCCL's ``Work.wait()`` makes the current stream wait for the collective's
end event; the host blocks only under ``TORCH_NCCL_BLOCKING_WAIT``).

One process stands in for a rank of two: the step module sees a world of 2 (its scale is
``world / count``) while the all-reduce itself runs on a real 1-rank group (gloo here, NCCL on a
GPU), whose sum is this rank's count: the gradient is then twice the window's token mean's.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from benchmarks.syncs import _texts, _TinyLM, text_forward
from trainkit.loop import step as step_module
from trainkit.loop.precision import Precision
from trainkit.loop.step import WindowStep


def _expected(window: list[dict[str, torch.Tensor]], device: torch.device
              ) -> dict[str, torch.Tensor]:
    """The gradient of the window's summed token loss over its count (one rank's view)."""
    torch.manual_seed(0)
    model = _TinyLM().to(device)
    total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in window)
    loss = sum(nn.functional.cross_entropy(*text_forward(model, b), reduction="sum")
               for b in window)
    (loss / total).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


class _Seen:
    """The all-reduces the step starts and the waits on their works, in order."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Any:
        work = dist.all_reduce(tensor, async_op=async_op)
        self.log.append(f"all_reduce async={async_op}")
        log = self.log

        class Work:
            def wait(self) -> bool:
                log.append("wait")
                return work.wait()
        return Work()


@pytest.fixture
def one_rank_of_two(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
                    ) -> Iterator[_Seen]:
    device = request.param
    if device.type == "cuda":
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=device)
        dist.all_reduce(torch.zeros(1, device=device))  # NCCL's set-up, before any strict mode
        torch.cuda.synchronize()
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    seen = _Seen()
    monkeypatch.setattr(step_module, "dist", types.SimpleNamespace(
        is_available=dist.is_available, is_initialized=dist.is_initialized,
        get_world_size=lambda group=None: 2, all_reduce=seen.all_reduce))
    try:
        yield seen
    finally:
        dist.destroy_process_group()


def _window_step(device: torch.device) -> tuple[WindowStep, dict[str, torch.Tensor]]:
    """The built-in step over the tiny LM (built before any strict sync mode: its weights'
    copy to the device is one), and the gradients its optimizer steps on, once it has run."""
    torch.manual_seed(0)
    model = _TinyLM().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen: dict[str, torch.Tensor] = {}
    optimizer.register_step_pre_hook(lambda *_: seen.update(
        {n: p.grad.detach().clone() for n, p in model.named_parameters()}))
    return WindowStep(model, optimizer=optimizer, precision=Precision("32"),
                      criterion=nn.CrossEntropyLoss(), forward=text_forward, device=device), seen


def _check(seen: _Seen, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    # one collective a window, started asynchronously, waited once (at the first optimize)
    assert seen.log == ["all_reduce async=True", "wait"]
    assert got.keys() == want.keys()
    for name in got:  # world (2) / the count: twice one rank's token mean
        torch.testing.assert_close(got[name], 2 * want[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("one_rank_of_two", [torch.device("cpu")], indirect=True,
                         ids=["cpu"])
def test_the_count_is_all_reduced_once_a_window_and_waited_before_its_use(
        one_rank_of_two: _Seen) -> None:
    window = _texts(3, torch.device("cpu"))
    step, got = _window_step(torch.device("cpu"))
    step(window)
    _check(one_rank_of_two, got, _expected(window, torch.device("cpu")))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("one_rank_of_two", [torch.device("cuda", 0)], indirect=True,
                         ids=["cuda"])
def test_a_counted_window_over_nccl_syncs_nothing_with_the_host(one_rank_of_two: _Seen) -> None:
    """The window (count, NCCL all-reduce, wait, backward, step) under
    ``set_sync_debug_mode("error")``: a host sync anywhere in it raises."""
    device = torch.device("cuda", 0)
    window = _texts(3, device)
    want = _expected(window, device)
    step, got = _window_step(device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(window)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _check(one_rank_of_two, got, want)
