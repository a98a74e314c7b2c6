from __future__ import annotations

from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import pytest
import torch

from trainkit.device import available_devices, move_to_device, resolve_device
from trainkit.errors import TrainkitError
from trainkit.runtime import Runtime

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA errors")


def test_auto_picks_best_available() -> None:
    device = resolve_device("auto")
    if torch.cuda.is_available():
        assert device == torch.device("cuda", 0)
    else:
        assert device.type in ("mps", "cpu")


def test_explicit_cpu() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")


@needs_no_cuda
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3"])
def test_missing_cuda_is_one_clear_line(spec: str) -> None:
    with pytest.raises(TrainkitError) as info:
        resolve_device(spec)
    message = str(info.value)
    assert "\n" not in message
    assert "CUDA is not available" in message
    assert "available here: cpu" in message


def test_unknown_device_names_the_choices() -> None:
    with pytest.raises(TrainkitError, match="use auto, cpu, cuda, cuda:N or mps"):
        resolve_device("gpu0")


def test_available_devices_lists_cpu_first() -> None:
    assert available_devices()[0] == "cpu"


Pair = namedtuple("Pair", ["x", "label"])


@dataclass
class Example:
    image: torch.Tensor
    name: str


def test_move_handles_nested_structures_and_leaves_others_alone() -> None:
    batch = {
        "pair": Pair(torch.ones(2), "cat"),
        "list": [torch.zeros(1), 3, (torch.ones(1), None)],
        "example": Example(torch.ones(3, dtype=torch.float64), "a"),
        "ordered": OrderedDict(a=torch.ones(1)),
        "meta": {"id": 7},
    }
    moved = move_to_device(batch, "cpu")
    assert isinstance(moved["pair"], Pair) and moved["pair"].label == "cat"
    assert isinstance(moved["list"], list) and moved["list"][1] == 3
    assert isinstance(moved["list"][2], tuple) and moved["list"][2][1] is None
    assert isinstance(moved["example"], Example) and moved["example"].name == "a"
    assert moved["example"].image.dtype == torch.float64
    assert isinstance(moved["ordered"], OrderedDict)
    assert moved["meta"] == {"id": 7}


def test_move_to_meta_device_moves_every_tensor() -> None:
    # The meta device exists everywhere, so this proves tensors really move, without a GPU.
    batch = (torch.ones(2), [torch.zeros(3)], {"k": torch.ones(1)})
    moved = move_to_device(batch, "meta")
    assert moved[0].device.type == "meta"
    assert moved[1][0].device.type == "meta"
    assert moved[2]["k"].device.type == "meta"
    assert batch[0].device.type == "cpu"  # the input is not modified


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_copy_is_asynchronous_on_cuda() -> None:
    x = torch.ones(1 << 20).pin_memory()
    y = move_to_device({"x": x}, "cuda")["x"]
    assert y.device.type == "cuda" and torch.equal(y.cpu(), x)


def test_runtime_reads_torchrun_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    rt = Runtime.from_env("cpu")
    assert (rt.rank, rt.local_rank, rt.world_size, rt.is_main) == (3, 1, 4, False)
    with pytest.raises(AttributeError):
        rt.rank = 0  # type: ignore[misc]
