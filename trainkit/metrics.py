"""Meters that accumulate on the device and are read only when logged."""

from __future__ import annotations

import torch


class DeviceMean:
    """Mean of scalar tensors without a host sync per value: one sync when it is read.

    Values are kept as tensors and folded into one every ``fold_every``, so rare logging does not
    hold a tensor per step, and adding a value costs no device op. Plain floats (values already
    read on the host) are summed on the host.
    """

    def __init__(self, fold_every: int = 256) -> None:
        self.fold_every = fold_every
        self._values: list[torch.Tensor] = []
        self._host = 0.0
        self._count = 0

    def add(self, value: torch.Tensor | float) -> None:
        self._count += 1
        if isinstance(value, float):
            self._host += value
            return
        self._values.append(value)
        if len(self._values) >= self.fold_every:
            self._values = [torch.stack(self._values).float().sum()]

    def pop(self) -> float:
        """The mean so far (syncs once), then start over; NaN when nothing was added."""
        if not self._count:
            return float("nan")
        total = self._host
        if self._values:
            total += torch.stack(self._values).float().sum().item()
        mean = total / self._count
        self._values, self._host, self._count = [], 0.0, 0
        return mean
