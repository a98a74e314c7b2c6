"""Exponential moving average of a model's weights, used for evaluation when enabled."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from trainkit.core.errors import TrainkitError
from trainkit.distributed import fsdp
from trainkit.distributed.ddp import unwrap


class EMA:
    """Keeps ``ema = decay * ema + (1 - decay) * weights`` after every optimizer step.

    Floating-point parameters and buffers (batch-norm statistics) are averaged; integer buffers
    are copied. The decay warms up as ``min(decay, (1 + n) / (10 + n))`` after ``n`` updates, so
    early averages are not dominated by the random initial weights (as in TensorFlow and timm).

    Example:
        >>> ema = EMA(model, decay=0.999)  # doctest: +SKIP
        >>> ema.update()                    # after each optimizer.step()
        >>> with ema.applied():             # evaluate with the averaged weights
        ...     evaluate(model)
    """

    def __init__(self, model: nn.Module, decay: float = 0.999) -> None:
        if not 0.0 < decay < 1.0:
            raise TrainkitError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.updates = 0
        # The model's own tensors, captured once (reading state_dict() every step is slow) and
        # detached, so the in-place updates below are never recorded by autograd.
        live = unwrap(model).state_dict(keep_vars=True)
        self._names = list(live)
        self.shadow = [t.detach().clone() for t in live.values()]
        # Under FSDP the weights are DTensors and so are their shadows, sharded alike (each rank
        # averages its own shard); the math below runs on the local shards, views that share
        # their storage (not every foreach op has a DTensor rule).
        self._live = [fsdp.local(t.detach()) for t in live.values()]
        self._shadow = [fsdp.local(t) for t in self.shadow]
        self._model = unwrap(model)
        self._sharded = fsdp.is_sharded(self._model)
        floating = [t.is_floating_point() for t in self._live]
        self._float = [i for i, f in enumerate(floating) if f]
        self._other = [i for i, f in enumerate(floating) if not f]

    def update(self) -> None:
        """Fold the model's current weights into the average."""
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        torch._foreach_lerp_([self._shadow[i] for i in self._float],
                             [self._live[i] for i in self._float], 1.0 - decay)
        for i in self._other:
            self._shadow[i].copy_(self._live[i])

    def restart(self) -> None:
        """Start the average over from the model's current weights (e.g. just loaded ones)."""
        torch._foreach_copy_(self._shadow, self._live)
        self.updates = 0

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Within this block the model holds the averaged weights; its own come back after."""
        saved = [t.clone() for t in self._live]
        self._regather()
        torch._foreach_copy_(self._live, self._shadow)
        try:
            yield
        finally:
            torch._foreach_copy_(self._live, saved)
            self._regather()

    def buffers(self) -> list[torch.Tensor]:
        """The averages of the model's buffers (batch-norm statistics); never sharded."""
        names = {name for name, _ in self._model.named_buffers()}
        return [t for name, t in zip(self._names, self.shadow) if name in names]

    def _regather(self) -> None:
        """FSDP: drop gathered copies of the weights, so forwards see the swapped shards."""
        if self._sharded:
            fsdp.reshard(self._model)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "updates": self.updates,
                "weights": dict(zip(self._names, self.shadow))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        weights = state["weights"]
        if list(weights) != self._names:
            raise TrainkitError("checkpoint's EMA weights do not match this model's parameters")
        torch._foreach_copy_(self._shadow, [fsdp.local(weights[name]) for name in self._names])
        self.updates = int(state["updates"])
