"""Pick a device and move (nested) batches onto it."""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import torch

from trainkit.core.errors import TrainkitError
from trainkit.core.tree import tree_map

T = TypeVar("T")
GIB = 2**30  # bytes in a GiB: every memory figure trainkit reports is in GiB


def available_devices() -> list[str]:
    """Names of the devices this process can use, e.g. ``["cpu", "cuda:0", "cuda:1"]``."""
    return _device_names(_cuda_count(), _mps_available())


def resolve_device(spec: str | torch.device = "auto", local_rank: int = 0,
                   local_world_size: int = 1) -> torch.device:
    """Turn ``auto``/``cpu``/``cuda``/``cuda:N``/``mps`` into a usable ``torch.device``.

    ``auto`` prefers ``cuda:<local_rank>``, then ``mps``, then ``cpu``. ``cuda`` means
    ``cuda:<local_rank>``, so one config serves every rank under torchrun. ``cpu`` asks nothing
    of CUDA, so a CPU job on a GPU machine creates no CUDA context.

    Raises:
        TrainkitError: the device does not exist here, or this rank has no GPU of its own;
            the message lists what exists.

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
    """
    text = str(spec).strip().lower()
    if text == "cpu":
        return torch.device("cpu")
    return choose_device(text, local_rank, cuda_count=_cuda_count(), mps=_mps_available(),
                         local_world_size=local_world_size)


def choose_device(spec: str, local_rank: int, *, cuda_count: int, mps: bool,
                  local_world_size: int = 1) -> torch.device:
    """:func:`resolve_device`'s decision, from the facts it gathers (a pure function).

    Args:
        spec: ``auto``, ``cpu``, ``cuda``, ``cuda:N`` or ``mps`` (lower case).
        local_rank: this process's rank on its node (torchrun's ``LOCAL_RANK``).
        cuda_count: visible CUDA devices (0 without CUDA).
        mps: whether Apple's MPS is usable.
        local_world_size: processes on this node (torchrun's ``LOCAL_WORLD_SIZE``).

    Raises:
        TrainkitError: as :func:`resolve_device`. A rank beyond the visible GPUs is an error, not
            a modulo: two ranks on one GPU would make NCCL fail (or share its memory silently).
    """
    names = ", ".join(_device_names(cuda_count, mps))
    if spec == "auto":
        if not cuda_count:
            return torch.device("mps") if mps else torch.device("cpu")
        spec = "cuda"
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise TrainkitError(
            f"unknown device {spec!r}: use auto, cpu, cuda, cuda:N or mps (available here: {names})"
        ) from None
    if device.type == "cuda":
        if not cuda_count:
            raise TrainkitError(
                f"device {spec!r} requested but CUDA is not available (available here: {names}): "
                "use trainer.device=auto or cpu; `python -m trainkit.env` tells more",
                details=[f"why no CUDA: {_why_no_cuda()}"])
        if device.index is None and local_rank >= cuda_count:
            raise TrainkitError(
                # (torchrun gives its workers one CUDA_VISIBLE_DEVICES: no per-rank GPU that way)
                f"LOCAL_RANK {local_rank} has no GPU: {cuda_count} visible; start at most "
                f"{cuda_count} processes per node (torchrun --nproc-per-node), or set "
                "trainer.device=cpu"
            )
        if device.index is not None and local_world_size > 1:
            raise TrainkitError(
                f"trainer.device={spec} would put all {local_world_size} processes of this node "
                "on one GPU: use trainer.device=cuda (each rank its own, cuda:LOCAL_RANK)"
            )
        index = local_rank if device.index is None else device.index
        if index >= cuda_count:
            raise TrainkitError(
                f"device cuda:{index} requested but only {cuda_count} CUDA device(s) are "
                f"visible; available here: {names}"
            )
        return torch.device("cuda", index)
    if device.type == "mps" and not mps:
        raise TrainkitError(f"device {spec!r} requested but MPS is not available; "
                            f"available here: {names}")
    if device.type not in ("cpu", "cuda", "mps"):
        raise TrainkitError(f"unsupported device {spec!r}: use auto, cpu, cuda, cuda:N or mps")
    return device


def bf16_native(capability: tuple[int, int], *, hip: bool = False) -> bool:
    """Whether a GPU of this compute capability runs bfloat16 natively: Ampere (8.0) and newer.

    Not ``torch.cuda.is_bf16_supported()``: it also counts emulation, so pre-Ampere cards (V100
    7.0, T4 7.5) would silently run a slow emulated bf16, and it asks the current device rather
    than the run's. ROCm GPUs that torch supports (``hip``) run bf16 natively.

    Example:
        >>> bf16_native((7, 5)), bf16_native((8, 0))
        (False, True)
    """
    return hip or tuple(capability) >= (8, 0)


def move_to_device(batch: T, device: torch.device | str) -> T:
    """Copy every tensor inside ``batch`` to ``device``; everything else is returned as is.

    Handles dicts, lists, tuples, namedtuples and dataclass instances, nested to any depth.
    The copy is asynchronous (``non_blocking=True``) only for pinned CPU tensors going to CUDA:
    that is the one case where it overlaps with compute and is safe.

    Example:
        >>> move_to_device({"x": torch.ones(2), "id": "a"}, "cpu")["id"]
        'a'
    """
    device = device if isinstance(device, torch.device) else torch.device(device)
    if type(batch) in _FLAT and _all_on(batch, device):
        return batch  # already placed (a prefetcher's, a CPU run's): no walk, no allocation
    return tree_map(functools.partial(_move, device=device), batch)


_FLAT = (tuple, list)  # the common batch, ``(inputs, targets)``: checked without the walker


def _all_on(batch: tuple[Any, ...] | list[Any], device: torch.device) -> bool:
    """Whether every item of a flat batch is a tensor already on ``device``."""
    for item in batch:  # noqa: SIM110 (all() over a generator allocates one per batch)
        if not isinstance(item, torch.Tensor) or item.device != device:
            return False
    return True


def _move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.device == device:
        return tensor
    non_blocking = device.type == "cuda" and tensor.device.type == "cpu" and tensor.is_pinned()
    return tensor.to(device, non_blocking=non_blocking)


def memory_stats(device: torch.device) -> dict[str, float]:
    """Allocator statistics in GiB for a CUDA device; empty elsewhere.

    ``allocated`` is what tensors hold; ``reserved`` is what the caching allocator keeps (what
    nvidia-smi shows); ``peak_allocated`` is the peak since the last
    ``torch.cuda.reset_peak_memory_stats``.
    """
    if device.type != "cuda":
        return {}
    return {
        "cuda_allocated_gib": torch.cuda.memory_allocated(device) / GIB,
        "cuda_reserved_gib": torch.cuda.memory_reserved(device) / GIB,
        "cuda_peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
    }


def _device_names(cuda_count: int, mps: bool) -> list[str]:
    return ["cpu", *(f"cuda:{i}" for i in range(cuda_count)), *(["mps"] if mps else [])]


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps and mps.is_available())


def _why_no_cuda() -> str:
    if torch.version.cuda is None:
        return f"this torch {torch.__version__} is a CPU-only build"
    return (f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but finds no "
            "usable GPU or driver")
