"""Mixed precision as one object: autocast, loss scaling, backward, unscale, step, state."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from trainkit.device import bf16_native
from trainkit.errors import TrainkitError

_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class Precision:
    """Runs forward passes under autocast and optimizer steps through a GradScaler for fp16.

    ``"32"`` is plain fp32. ``"bf16-mixed"`` autocasts to bfloat16 (CPU and recent GPUs) and needs
    no scaler. ``"16-mixed"`` autocasts to float16 and scales the loss so small gradients survive;
    a step whose gradients overflowed is skipped by the scaler, and :meth:`step` returns False so
    the caller does not advance its LR scheduler.

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
        if self.mode != "32" and self.mode not in _DTYPES:
            raise TrainkitError(f"unknown precision {mode!r}: use 32, bf16-mixed or 16-mixed")
        self.dtype = _DTYPES.get(self.mode)
        _check_supported(self.mode, self.device)
        self.scaler = torch.amp.GradScaler(self.device.type) if self.mode == "16-mixed" else None
        self._unscaled: set[int] = set()  # optimizers unscaled since the last step
        self._no_autocast = contextlib.nullcontext()  # reused: this runs every micro-step

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

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer unless fp16 gradients overflowed; True when it stepped."""
        if self.scaler is None:
            optimizer.step()
            return True
        self.unscale_(optimizer)
        # Whether the scaler let the optimizer step, through public APIs only: a step post-hook
        # runs exactly when optimizer.step() ran (the scaler skips it on overflow; the flag it
        # had read costs no second wait). A fused optimizer (Adam(fused=True)) always runs and
        # skips inside its kernel on the `found_inf` GradScaler hands it for that.
        ran: list[torch.Tensor | None] = []
        handle = optimizer.register_step_post_hook(
            lambda opt, args, kwargs: ran.append(getattr(opt, "found_inf", None)))
        try:
            self.scaler.step(optimizer)
        finally:
            handle.remove()
        self.scaler.update()
        self._unscaled.clear()
        if not ran:
            return False
        return ran[0] is None or not ran[0].item()  # fused: a sync on its flag

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
