"""A metrics sink that records every call, for tests of what a run tells its sinks."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


class RecordingSink:
    """A :class:`~trainkit.observe.sinks.MetricsSink` with all four methods, recording them."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def start(self, run_dir: Path | None, config: Mapping[str, Any]) -> None:
        self.calls.append(("start", dict(config)))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.calls.append(("log", (dict(metrics), step)))

    def finish(self, status: str, summary: Mapping[str, Any]) -> None:
        self.calls.append(("finish", (status, dict(summary))))

    def close(self) -> None:
        self.calls.append(("close", None))

    def named(self, name: str) -> list[Any]:
        return [args for call, args in self.calls if call == name]
