from __future__ import annotations

from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import pytest
import torch

from trainkit.core.device import available_devices, choose_device, move_to_device, resolve_device
from trainkit.core.errors import TrainkitError
from trainkit.core.runtime import Runtime

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


@pytest.mark.parametrize(("spec", "local_rank", "cuda_count", "expected"), [
    ("auto", 0, 0, "cpu"),
    ("auto", 1, 2, "cuda:1"),
    ("cuda", 1, 2, "cuda:1"),
    ("cuda:1", 0, 2, "cuda:1"),
    ("cpu", 3, 2, "cpu"),  # a CPU job on a GPU machine stays on the CPU, whatever its rank
])
def test_device_choice_from_rank_and_visible_gpus(spec: str, local_rank: int, cuda_count: int,
                                                  expected: str) -> None:
    assert choose_device(spec, local_rank, cuda_count=cuda_count, mps=False) == \
        torch.device(expected)


@pytest.mark.parametrize("spec", ["auto", "cuda"])
def test_more_ranks_than_gpus_is_one_line_not_a_modulo(spec: str) -> None:
    with pytest.raises(TrainkitError) as info:  # rank 1 on a one-GPU machine: not cuda:0 again
        choose_device(spec, 1, cuda_count=1, mps=False, local_world_size=2)
    message = str(info.value)
    assert message.startswith("LOCAL_RANK 1 has no GPU: 1 visible")
    assert "trainer.device=cpu" in message and len(message) <= 200 and "\n" not in message


def test_one_explicit_gpu_for_all_ranks_of_a_node_is_refused() -> None:
    with pytest.raises(TrainkitError, match="all 2 processes of this node on one GPU"):
        choose_device("cuda:0", 1, cuda_count=2, mps=False, local_world_size=2)
    # one process per GPU through CUDA_VISIBLE_DEVICES (no torchrun on the node): fine
    assert choose_device("cuda:0", 1, cuda_count=1, mps=False) == torch.device("cuda", 0)
