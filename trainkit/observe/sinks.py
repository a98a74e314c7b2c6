"""Where logged metrics go: the loop hands one dict per logging step to every sink.

TensorBoard (``<run_dir>/tb``) and ``<run_dir>/metrics.jsonl`` are built in; anything with
``log(metrics, step)`` is a sink too (``Trainer(..., sinks=[...])``), run on rank 0 only, with
optional ``start(run_dir, config)``, ``finish(status, summary)`` and ``close()`` (last, however
the run ended), each called once. A sink never takes a run down: its first error is one warning
line and it gets nothing more. Trackers keep their run ids in ``<run_dir>/trackers/<name>.json``
(:func:`remember_tracker_run`), so a resumed run appends to the same tracker run.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from trainkit.core.errors import one_line

METRICS_FILE = "metrics.jsonl"
TRACKERS_DIR = "trackers"  # <run_dir>/trackers/<name>.json: a tracker's run id, for a resume
log = logging.getLogger("trainkit")


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
    """Several sinks as one: each call goes to every sink that has that method.

    A sink that raises is dropped for the rest of the run with one warning line (see the
    module's docstring); the run and the other sinks go on.
    """

    def __init__(self, sinks: Iterable[MetricsSink] = ()) -> None:
        self.sinks = list(sinks)
        for sink in self.sinks:
            if not isinstance(sink, MetricsSink):
                raise TypeError(f"a metrics sink needs a log(metrics, step) method; "
                                f"{type(sink).__name__} has none")
        self._all = list(self.sinks)  # close() reaches the dropped ones too

    def start(self, run_dir: str | Path | None, config: Mapping[str, Any]) -> None:
        """Tell the sinks which run begins (see the module's docstring)."""
        self._each("start", Path(run_dir) if run_dir is not None else None, config)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for sink in self.sinks:
            try:
                sink.log(metrics, step)
            except Exception as err:  # a tracker's outage is no reason to stop training
                self._drop(sink, err)

    def finish(self, status: str, summary: Mapping[str, Any]) -> None:
        """Tell the sinks how the run ended: its status and ``summary.json``'s contents."""
        self._each("finish", status, summary)

    def close(self) -> None:
        """Close every sink that can be closed, those dropped after an error included."""
        active = self.sinks
        for sink in self._all:
            close = getattr(sink, "close", None)
            try:
                if close is not None:
                    close()
            except Exception as err:
                if sink in active:  # a dropped sink said what was wrong already
                    warn_failed(type(sink).__name__, err)
        self.sinks = []

    def _each(self, method: str, *args: Any) -> None:
        for sink in self.sinks:
            call = getattr(sink, method, None)
            try:
                if call is not None:
                    call(*args)
            except Exception as err:
                self._drop(sink, err)

    def _drop(self, sink: MetricsSink, err: Exception) -> None:
        self.sinks = [s for s in self.sinks if s is not sink]  # a loop over the old list goes on
        warn_failed(type(sink).__name__, err)


def warn_failed(name: str, err: BaseException | str) -> None:
    """The one line that says a sink failed and is off for the rest of the run.

    ``err``: the error, or its ``"Type: message"`` as a sink's own process reported it.
    """
    reason = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
    log.warning("metrics sink %s failed and is off for the rest of this run (%s); "
                "training goes on, and metrics.jsonl has every metric", name,
                one_line(reason, 200))


def remember_tracker_run(run_dir: Path | None, name: str, run: Mapping[str, Any]) -> None:
    """Keep a tracker's run (its id and where it is) in ``<run_dir>/trackers/<name>.json``."""
    if run_dir is None:
        return
    path = Path(run_dir) / TRACKERS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(dict(run), indent=2) + "\n")
    os.replace(tmp, path)  # a reader sees the old file or the new one, never half of one


def tracker_runs(run_dir: Path | None) -> dict[str, dict[str, Any]]:
    """The tracker runs kept in ``run_dir`` by :func:`remember_tracker_run`, by tracker name."""
    folder = Path(run_dir) / TRACKERS_DIR if run_dir is not None else None
    if folder is None or not folder.is_dir():
        return {}
    runs: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("*.json")):
        try:
            runs[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError):  # unreadable: that tracker starts a new run
            continue
    return runs


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
