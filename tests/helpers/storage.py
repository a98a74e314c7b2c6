"""A checkpoint storage that keeps nothing: it records what the Checkpointer asked of it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn


class RecordingStorage:
    """The :class:`~trainkit.checkpoint.storages.Storage` verbs, recording the saves and polls.

    It has the verbs of the protocol before and after the storages' unification (branch i39b:
    ``list`` and ``holds`` of a path or a state; ``path_of``, ``resumes``, ``latest`` and ``owns``
    before): the ones the Checkpointer no longer calls can go once both are merged.

    Args:
        polls_to_publish: how many :meth:`poll` calls an async save stays in flight for (0: a
            save is on disk when :meth:`save` returns, as a synchronous one is).
    """

    def __init__(self, polls_to_publish: int = 0) -> None:
        self.polls_to_publish = polls_to_publish
        self.saves: list[tuple[int, bool, bool]] = []  # (step, periodic, best)
        self.polls: list[int] = []  # the step of the newest save when each poll came
        self._left = 0  # polls until the save in flight is published

    @property
    def last(self) -> Path:
        return Path("last.pt")

    @property
    def in_flight(self) -> bool:
        return self._left > 0

    def save(self, step: int, content: Any, *, periodic: bool, best: bool) -> Path | None:
        self.saves.append((step, periodic, best))
        self._left = self.polls_to_publish
        return None  # nothing written anywhere

    @property
    def saved_steps(self) -> list[int]:
        return [step for step, _, _ in self.saves]

    def path_of(self, step: int, *, periodic: bool) -> Path | None:
        return None

    def resumes(self, model: nn.Module) -> bool:
        return False

    def latest(self) -> dict[str, Any] | None:
        return None

    def list(self) -> list[Path]:
        return []

    def holds(self, checkpoint: Any) -> bool:
        return False

    def read(self, path: Path, key: str) -> dict[str, Any]:
        raise AssertionError("nothing to read")

    def owns(self, state: Mapping[str, Any]) -> bool:
        return False

    def load(self, state: Mapping[str, Any], parts: Mapping[str, Any], *, key: str,
             optimizer: bool) -> bool:
        raise AssertionError("nothing to load")

    def carry_over(self, state: Mapping[str, Any], counters: Any, data: Any) -> str:
        return ""

    def poll(self) -> None:
        self.polls.append(self.saves[-1][0] if self.saves else -1)
        self._left = max(0, self._left - 1)

    def wait(self) -> None:
        self._left = 0

    def close(self) -> None:
        self._left = 0
