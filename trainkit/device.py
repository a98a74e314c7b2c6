"""Pick a device and move (nested) batches onto it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

import torch

from trainkit.errors import TrainkitError

T = TypeVar("T")


def available_devices() -> list[str]:
    """Names of the devices this process can use, e.g. ``["cpu", "cuda:0", "cuda:1"]``."""
    names = ["cpu"]
    if torch.cuda.is_available():
        names += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if _mps_available():
        names.append("mps")
    return names


def resolve_device(spec: str | torch.device = "auto", local_rank: int = 0) -> torch.device:
    """Turn ``auto``/``cpu``/``cuda``/``cuda:N``/``mps`` into a usable ``torch.device``.

    ``auto`` prefers ``cuda:<local_rank>``, then ``mps``, then ``cpu``. ``cuda`` means
    ``cuda:<local_rank>``, so one config serves every rank under torchrun.

    Raises:
        TrainkitError: the device does not exist here; the message lists what does.

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
    """
    text = str(spec).strip().lower()
    if text == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise TrainkitError(
            f"unknown device {spec!r}: use auto, cpu, cuda, cuda:N or mps "
            f"(available here: {', '.join(available_devices())})"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise TrainkitError(
                f"device {spec!r} requested but CUDA is not available (available here: "
                f"{', '.join(available_devices())}): use trainer.device=auto or cpu; "
                "`python -m trainkit.env` tells more",
                details=[f"why no CUDA: {_why_no_cuda()}"])
        index = local_rank if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise TrainkitError(
                f"device cuda:{index} requested but only {torch.cuda.device_count()} CUDA "
                f"device(s) are visible; available here: {', '.join(available_devices())}"
            )
        return torch.device("cuda", index)
    if device.type == "mps" and not _mps_available():
        raise TrainkitError(
            f"device {spec!r} requested but MPS is not available; "
            f"available here: {', '.join(available_devices())}"
        )
    if device.type not in ("cpu", "cuda", "mps"):
        raise TrainkitError(f"unsupported device {spec!r}: use auto, cpu, cuda, cuda:N or mps")
    return device


def move_to_device(batch: T, device: torch.device | str) -> T:
    """Copy every tensor inside ``batch`` to ``device``; everything else is returned as is.

    Handles dicts, lists, tuples, namedtuples and dataclass instances, nested to any depth.
    The copy is asynchronous (``non_blocking=True``) only for pinned CPU tensors going to CUDA:
    that is the one case where it overlaps with compute and is safe.

    Example:
        >>> move_to_device({"x": torch.ones(2), "id": "a"}, "cpu")["id"]
        'a'
    """
    return _move(batch, device if isinstance(device, torch.device) else torch.device(device))


def _move(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.device == device:
            return obj
        non_blocking = device.type == "cuda" and obj.device.type == "cpu" and obj.is_pinned()
        return obj.to(device, non_blocking=non_blocking)
    cls = type(obj)
    # Sequences before Mapping: isinstance against an ABC is slow, and this runs every step.
    if isinstance(obj, (list, tuple)):
        items = [_move(v, device) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj  # nothing moved (already there): no new container
        return cls(*items) if hasattr(obj, "_fields") else cls(items)  # namedtuple or not
    if isinstance(obj, Mapping):
        moved = {k: _move(v, device) for k, v in obj.items()}
        try:
            return cls(moved)  # keeps OrderedDict and other dict subclasses
        except TypeError:  # e.g. defaultdict, whose constructor wants a factory first
            return moved
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _move(getattr(obj, f.name), device) for f in dataclasses.fields(obj)
                   if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def memory_stats(device: torch.device) -> dict[str, float]:
    """Allocator statistics in GiB for a CUDA device; empty elsewhere.

    ``allocated`` is what tensors hold; ``reserved`` is what the caching allocator keeps (what
    nvidia-smi shows); ``peak_allocated`` is the peak since the last
    ``torch.cuda.reset_peak_memory_stats``.
    """
    if device.type != "cuda":
        return {}
    gib = 2**30
    return {
        "cuda_allocated_gib": torch.cuda.memory_allocated(device) / gib,
        "cuda_reserved_gib": torch.cuda.memory_reserved(device) / gib,
        "cuda_peak_allocated_gib": torch.cuda.max_memory_allocated(device) / gib,
    }


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps and mps.is_available())


def _why_no_cuda() -> str:
    if torch.version.cuda is None:
        return f"this torch {torch.__version__} is a CPU-only build"
    return (f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but finds no "
            "usable GPU or driver")
