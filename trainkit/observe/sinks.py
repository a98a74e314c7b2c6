"""Where logged metrics go: the loop hands one dict per logging step to every sink.

TensorBoard (``<run_dir>/tb``) and JSON lines (``<run_dir>/metrics.jsonl``) are the built-in
sinks; anything with ``log(metrics, step)`` (and, optionally, ``close()``) is one too: pass it as
``Trainer(..., sinks=[...])``. Sinks run on rank 0 only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

METRICS_FILE = "metrics.jsonl"


@runtime_checkable
class MetricsSink(Protocol):
    """Receives the metrics of one logging step, e.g. ``{"train/loss": 0.3, ...}``."""

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...


class TensorBoardSink:
    """Each metric as a TensorBoard scalar under its own tag, in ``log_dir``."""

    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when used

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


class JsonlSink:
    """One JSON object per logging step, ``{"step": N, "train/loss": ...}``, appended to ``path``.

    For scripts and plots without TensorBoard: ``pandas.read_json(path, lines=True)``. A resumed
    run appends to the same file, so the steps between the last checkpoint and a stop appear
    twice; the later line is the resumed run's. NaN and inf are written as null (JSON has none).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (open for the run)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        record = {"step": step, **{k: _number(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # logging steps are rare; a reader (tail -f, a plot) sees each at once

    def close(self) -> None:
        self._file.close()


class Sinks:
    """Several sinks as one: ``log`` goes to each, ``close`` closes those that can be closed."""

    def __init__(self, sinks: Iterable[MetricsSink] = ()) -> None:
        self.sinks = list(sinks)
        for sink in self.sinks:
            if not isinstance(sink, MetricsSink):
                raise TypeError(f"a metrics sink needs a log(metrics, step) method; "
                                f"{type(sink).__name__} has none")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def close(self) -> None:
        for sink in self.sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                close()


def default_sinks(run_dir: str | Path | None, is_main: bool = True,
                  extra: Iterable[MetricsSink] = ()) -> Sinks:
    """TensorBoard and metrics.jsonl in ``run_dir`` plus ``extra``, on rank 0; none elsewhere."""
    if not is_main:
        return Sinks()
    built: list[MetricsSink] = []
    if run_dir is not None:
        built = [TensorBoardSink(Path(run_dir) / "tb"), JsonlSink(Path(run_dir) / METRICS_FILE)]
    return Sinks([*built, *extra])


def _number(value: Any) -> Any:
    if isinstance(value, int):
        return value
    value = float(value)
    return value if math.isfinite(value) else None
