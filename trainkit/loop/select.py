"""A torchmetrics metric on one output (and one target) of several, without a subclass."""

from __future__ import annotations

from typing import Any

from torch import nn


class Select(nn.Module):
    """Apply ``metric`` to ``outputs[output]`` and ``targets[target]`` (an index or a key; None:
    the whole); ``reset``, ``compute``, ``state_dict`` and ``.to`` pass through to the metric.

    A module, so that moving it moves the metric's states, and the Trainer's cross-rank sync
    is the metric's own.

    Example:
        >>> metrics = {"acc_a": Select(MulticlassAccuracy(10), output=0, target=0),
        ...            "acc_b": Select(MulticlassAccuracy(5), output="b", target="b")}
        ... # doctest: +SKIP
    """

    def __init__(self, metric: Any, output: int | str | None = None,
                 target: int | str | None = None) -> None:
        super().__init__()
        self.metric, self.output, self.target = metric, output, target

    def update(self, outputs: Any, targets: Any) -> None:
        self.metric.update(_pick(outputs, self.output), _pick(targets, self.target))

    def forward(self, outputs: Any, targets: Any) -> Any:
        return self.metric(_pick(outputs, self.output), _pick(targets, self.target))

    def compute(self) -> Any:
        return self.metric.compute()

    def reset(self) -> None:
        self.metric.reset()


def _pick(values: Any, key: int | str | None) -> Any:
    return values if key is None else values[key]
