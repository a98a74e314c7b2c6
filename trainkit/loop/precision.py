"""Mixed precision as one object: autocast, loss scaling, backward, unscale, step, state; and
``auto``, the precision that fits the machine (:func:`choose_precision`)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from trainkit.core.device import bf16_native
from trainkit.core.errors import TrainkitError

_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class Precision:
    """Runs forward passes under autocast and optimizer steps through a GradScaler for fp16.

    ``"32"`` is plain fp32; ``"bf16-mixed"`` autocasts to bfloat16, no scaler; ``"16-mixed"``
    autocasts to float16 and scales the loss, and :meth:`step` returns False for a step the scaler
    skipped (overflow). ``"auto"`` picks one for the device (:func:`choose_precision`): ``mode`` and
    ``reason`` say which and why.

    Example:
        >>> precision = Precision("bf16-mixed", torch.device("cpu"))
        >>> with precision.autocast():
        ...     loss = model(x).sum()  # doctest: +SKIP
        >>> precision.backward(loss)  # doctest: +SKIP
        >>> stepped = precision.step(optimizer)  # doctest: +SKIP
    """

    def __init__(self, mode: str = "32", device: torch.device | str = "cpu") -> None:
        self.mode = str(mode)
        self.device = torch.device(device)
        if self.mode not in ("auto", "32", *_DTYPES):
            raise TrainkitError(f"unknown precision {mode!r}: use auto, 32, bf16-mixed or "
                                "16-mixed")
        self.reason = ""  # why auto picked the mode; "" when it was given
        self.warning = None  # a line to log: the mode given is likely slow on this device
        if self.mode == "auto" or (self.mode == "bf16-mixed" and self.device.type == "cpu"):
            hardware = Hardware.of(self.device)
            if self.mode == "auto":
                self.mode, self.reason = choose_precision(hardware)
            else:
                self.warning = slow_bf16_warning(hardware)
        self.dtype = _DTYPES.get(self.mode)
        _check_supported(self.mode, self.device)
        self.scaler = torch.amp.GradScaler(self.device.type) if self.mode == "16-mixed" else None
        self._unscaled: set[int] = set()  # optimizers unscaled since the last step
        self._skips: torch.Tensor | None = None  # fused steps skipped on overflow, unread
        self._no_autocast = contextlib.nullcontext()  # reused: this runs every micro-step

    def describe(self) -> str:
        """The mode, and when ``auto`` picked it, why: ``"bf16-mixed (auto: ...)"``."""
        return f"{self.mode} (auto: {self.reason})" if self.reason else self.mode

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Context for the forward pass and loss."""
        if self.dtype is None:
            return self._no_autocast
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients to their true size (before clipping or reading their norm)."""
        if self.scaler is not None and id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def step(self, optimizer: torch.optim.Optimizer, update: bool = True) -> bool:
        """Step the optimizer unless fp16 gradients overflowed; True when it stepped.

        ``update=False`` leaves the loss scale as it is: torch's recipe for several optimizers
        steps each through the scaler and updates the scale once per iteration
        (:meth:`update`). A fused optimizer (``AdamW(fused=True)``) skips an overflowed step
        inside its kernel, on the device: it reports True without a host read, and the skip is
        counted by :meth:`read_skips` where the loop reads anyway.
        """
        if self.scaler is None:
            optimizer.step()
            return True
        self.unscale_(optimizer)
        unset = _unset_momentum(optimizer)
        # Whether the scaler let the optimizer step, through public APIs only: a step post-hook
        # runs exactly when optimizer.step() ran (the scaler skips it on overflow; the flag it
        # had read costs no second wait). A fused optimizer always runs and skips inside its
        # kernel on the `found_inf` GradScaler hands it for that.
        ran: list[torch.Tensor | None] = []
        handle = optimizer.register_step_post_hook(
            lambda opt, args, kwargs: ran.append(getattr(opt, "found_inf", None)))
        try:
            self.scaler.step(optimizer)
        finally:
            handle.remove()
        if update:
            self.update()
        found_inf = ran[0] if ran else None
        if found_inf is None:
            stepped = bool(ran)
        elif unset:  # a fused SGD's first step: what a skip left must be undone (one read, once)
            stepped = not found_inf.item()  # host sync, at the first step only
        else:  # fused: no host read; the skip is counted on the device
            self._skips = found_inf.detach().clone() if self._skips is None else (
                self._skips + found_inf)
            stepped = True
        if unset and not stepped:  # what the skipped first step left: the next one is a first
            for param in unset:
                optimizer.state[param].pop("momentum_buffer", None)
        return stepped

    def update(self) -> None:
        """Update the loss scale once for the iteration (after every optimizer's :meth:`step`
        with ``update=False``)."""
        if self.scaler is not None:
            self.scaler.update()
        self._unscaled.clear()

    def forget_unscaled(self) -> None:
        """No optimizer counts as unscaled (a window whose steps were all skipped by the
        NaN/inf check after clipping unscaled them: the next window unscales anew)."""
        self._unscaled.clear()

    def read_skips(self) -> int:
        """Steps a fused optimizer skipped on an fp16 overflow since the last read (a host read
        when there were fused steps; 0 without one)."""
        if self._skips is None:
            return 0
        skips, self._skips = int(self._skips.item()), None  # host sync
        return skips

    def reset(self) -> None:
        """Forget a step cut short after :meth:`unscale_` (an out-of-memory error in clipping,
        retried): no optimizer counts as unscaled, and the loss scaler keeps its scale but none
        of the step's per-optimizer state (its stage, its ``found_inf``), as a fresh GradScaler
        given the old one's ``state_dict`` (GradScaler's public API has no reset of its own)."""
        self._unscaled.clear()
        if self.scaler is not None:
            fresh = torch.amp.GradScaler(self.device.type)
            fresh.load_state_dict(self.scaler.state_dict())  # reads the scale: a host sync
            self.scaler = fresh

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("mode") != self.mode:
            raise TrainkitError(
                f"checkpoint was trained with precision {state.get('mode')!r} but this run uses "
                f"{self.mode!r}: set trainer.precision={state.get('mode')} to resume it"
            )
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


def _unset_momentum(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Fused SGD with momentum before its first step: its parameters (else none). Its kernel
    creates the momentum buffers (``empty_like``) before it skips a step on GradScaler's
    ``found_inf``: a skipped first step must not leave them uninitialised for the next."""
    groups = optimizer.param_groups
    if not (isinstance(optimizer, torch.optim.SGD) and groups and groups[0]["params"]
            and any(g.get("fused") and g.get("momentum") for g in groups)):
        return []
    if optimizer.state.get(groups[0]["params"][0], {}).get("momentum_buffer") is not None:
        return []  # made by a step taken (the common case, without a walk)
    return [param for group in groups for param in group["params"]
            if optimizer.state.get(param, {}).get("momentum_buffer") is None]


# x86 CPU features that run bfloat16 matrix products natively (/proc/cpuinfo's names).
CPU_BF16_FLAGS = {"avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX"}


@dataclass(frozen=True)
class Hardware:
    """The facts :func:`choose_precision` decides on; :meth:`of` reads them for a device.

    Attributes:
        device_type: ``"cuda"``, ``"cpu"``, ``"mps"``, ...
        cuda_capability: CUDA devices: the compute capability, e.g. ``(8, 0)``.
        hip: a ROCm build (its GPUs run bf16 natively).
        cpu_capability: the instruction set torch's CPU kernels use
            (``torch.backends.cpu.get_cpu_capability()``: ``"AVX2"``, ``"AVX512"``, ...).
        cpu_flags: the CPU's feature flags (``/proc/cpuinfo``; empty where it is missing).
        onednn_max_isa: ``ONEDNN_MAX_CPU_ISA`` when set: oneDNN (convolutions, matrix products)
            uses no instruction set above it.
    """

    device_type: str
    cuda_capability: tuple[int, int] | None = None
    hip: bool = False
    cpu_capability: str = ""
    cpu_flags: frozenset[str] = field(default_factory=frozenset, repr=False)
    onednn_max_isa: str | None = None

    @classmethod
    def of(cls, device: torch.device | str) -> Hardware:
        device = torch.device(device)
        if device.type == "cuda":
            return cls("cuda", tuple(torch.cuda.get_device_capability(device)),
                       hip=bool(torch.version.hip))
        if device.type != "cpu":
            return cls(device.type)
        return cls("cpu", cpu_capability=torch.backends.cpu.get_cpu_capability(),
                   cpu_flags=cpu_flags(),
                   onednn_max_isa=os.environ.get("ONEDNN_MAX_CPU_ISA")
                   or os.environ.get("DNNL_MAX_CPU_ISA"))


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first CPU's feature flags (Linux); empty where the file is missing."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_bf16(hardware: Hardware) -> tuple[bool, str]:
    """Whether the CPU runs bf16 natively for torch, and the words that say why (or why not).

    Native means AVX512-BF16 or AMX instructions (flags) that torch's kernels may use: not when
    ``ATEN_CPU_CAPABILITY`` capped them below AVX512, or ``ONEDNN_MAX_CPU_ISA`` capped oneDNN
    below its bf16 instruction sets.
    """
    native = [name for flag, name in CPU_BF16_FLAGS.items() if flag in hardware.cpu_flags]
    if not native:
        return False, "the CPU has no native bf16 (AVX512-BF16 or AMX)"
    has = f"the CPU has {' and '.join(native)}"
    if hardware.cpu_capability not in ("AVX512", ""):
        return False, f"{has}, but torch's CPU kernels use {hardware.cpu_capability}"
    isa = (hardware.onednn_max_isa or "ALL").upper()
    if isa != "ALL" and not any(word in isa for word in ("BF16", "AMX", "AVX10")):
        return False, f"{has}, but ONEDNN_MAX_CPU_ISA={hardware.onednn_max_isa} caps oneDNN"
    return True, has


def choose_precision(hardware: Hardware) -> tuple[str, str]:
    """What ``trainer.precision=auto`` runs, and why: the fastest mode that trains reliably.

    ``bf16-mixed`` on CUDA GPUs with native bf16 (compute capability 8.0+, ROCm), ``16-mixed``
    on older ones; ``32`` on MPS; on a CPU ``bf16-mixed`` only with native bf16 (:func:`cpu_bf16`):
    elsewhere autocast emulates it, slower than ``32``.

    Example:
        >>> choose_precision(Hardware("cuda", (7, 5)))
        ('16-mixed', 'compute capability 7.5 has no native bf16')
    """
    if hardware.device_type == "cuda":
        major, minor = hardware.cuda_capability or (0, 0)
        if bf16_native((major, minor), hip=hardware.hip):
            return "bf16-mixed", "ROCm GPUs have native bf16" if hardware.hip else (
                f"compute capability {major}.{minor} has native bf16")
        return "16-mixed", f"compute capability {major}.{minor} has no native bf16"
    if hardware.device_type == "cpu":
        native, why = cpu_bf16(hardware)
        return ("bf16-mixed", why) if native else ("32", why)
    return "32", f"fp32 on {hardware.device_type}"


def slow_bf16_warning(hardware: Hardware) -> str | None:
    """The warning for ``bf16-mixed`` given explicitly on a CPU without native bf16, else None."""
    native, why = cpu_bf16(hardware)
    if native:
        return None
    return (f"trainer.precision=bf16-mixed on this CPU is likely several times slower than 32: "
            f"{why} (trainer.precision=auto picks for the machine)")


def _check_supported(mode: str, device: torch.device) -> None:
    if mode == "bf16-mixed" and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)  # of the run's device
        if not bf16_native(capability, hip=bool(torch.version.hip)):
            raise TrainkitError(
                f"bf16-mixed needs a GPU with native bfloat16 (compute capability 8.0+); "
                f"{device} ({torch.cuda.get_device_name(device)}) has "
                f"{capability[0]}.{capability[1]}: use trainer.precision=16-mixed"
            )
    if mode == "16-mixed" and device.type not in ("cuda", "cpu", "mps"):
        raise TrainkitError(f"16-mixed is not supported on {device.type}: use bf16-mixed or 32")
