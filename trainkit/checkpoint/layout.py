"""The names of a run's checkpoints and their rotation, for every storage.

Inside ``<run>/checkpoints`` a storage keeps ``step_<N><suffix>`` for periodic saves (``N``
zero-padded to 9 digits), ``last<suffix>``, the newest complete checkpoint, and
``best<suffix>``, the best by ``checkpoint.monitor``; something being written is named
``.<name>.tmp`` until it is whole. The suffix is ``.pt`` for files
(:mod:`~trainkit.checkpoint.files`) and empty for directories
(:mod:`~trainkit.checkpoint.sharded`, where ``last`` and ``best`` are symlinks to a
``step_<N>``). How the bytes are written is the storage's business; which names exist, which
one to resume from and which ones rotate away is decided here, once.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from trainkit.core.errors import TrainkitError, one_line

log = logging.getLogger("trainkit")
_STEP = re.compile(r"^step_(\d+)")


def tmp_path(path: Path) -> Path:
    """Where ``path`` is written until it is whole: a hidden name no reader takes for it."""
    return path.with_name(f".{path.name}.tmp")


class Layout:
    """The checkpoint names in ``directory``: files when ``suffix`` is ``".pt"``, directories
    when it is empty.

    Example:
        >>> layout = Layout(Path("runs/a/checkpoints"), keep_last=2, suffix=".pt")
        >>> layout.step_path(100).name
        'step_000000100.pt'
    """

    def __init__(self, directory: str | Path, keep_last: int = 3, *, suffix: str) -> None:
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.suffix = suffix

    @property
    def last(self) -> Path:
        return self.directory / f"last{self.suffix}"

    @property
    def best(self) -> Path:
        return self.directory / f"best{self.suffix}"

    def step_path(self, step: int) -> Path:
        """The name of step ``step``'s periodic checkpoint."""
        return self.directory / f"step_{step:09d}{self.suffix}"

    def step_of(self, name: str) -> int | None:
        """The step a periodic checkpoint's ``name`` gives; None for any other name."""
        match = _STEP.match(name)
        if match is None or name[match.end():] != self.suffix:
            return None
        return int(match.group(1))

    def steps(self) -> list[Path]:
        """The periodic checkpoints present, oldest first (files or directories, by suffix)."""
        found = [(step, self.directory / name) for name, is_dir in self.entries()
                 if (step := self.step_of(name)) is not None and is_dir == (not self.suffix)]
        return [path for _, path in sorted(found)]

    def entries(self) -> list[tuple[str, bool]]:
        """The names in the directory, each with whether it is a directory."""
        if not self.directory.is_dir():
            return []
        return [(path.name, path.is_dir()) for path in self.directory.iterdir()]

    def _exists(self, path: Path) -> bool:
        return path.exists()

    def _target(self, link: Path) -> str | None:
        """The name the link ``link`` points at; None for a missing one or a plain file."""
        return _link_target(link)

    def leftovers(self) -> list[Path]:
        """Periodic checkpoints that were being written when their save died."""
        if not self.directory.is_dir():
            return []
        return [path for path in self.directory.iterdir()
                if path.name.startswith(".") and path.name.endswith(".tmp")
                and self.step_of(path.name[1:-4]) is not None]

    def candidates(self) -> list[Path]:
        """What to resume from, newest first: ``last`` (the step it links to, where it is a
        link), then the periodic ones. Each name once."""
        found = list(reversed(self.steps()))
        target = self._target(self.last)
        last = self.directory / target if target is not None else self.last
        if self._exists(last):
            found = [last, *(path for path in found if path.name != last.name)]
        return found

    def stale(self) -> list[Path]:
        """Periodic checkpoints beyond the newest ``keep_last`` that no link names (a hard
        link's name holds its own bytes; a symlink needs its target): the rotation removes
        them, after the newest one is durable."""
        linked = {self._target(self.last), self._target(self.best)}
        return [path for path in self.steps()[: -self.keep_last] if path.name not in linked]


class Named:
    """The names of a writer's :attr:`layout` as the writer spells them (:meth:`name`: a path on
    a disk, a URL in a store): written once for every writer, files or directories, local or
    not."""

    layout: Layout

    def name(self, path: Path) -> Path | str:
        """How this writer names ``path`` of its layout (a path, unless it lies in a store)."""
        return path

    @property
    def keep_last(self) -> int:
        return self.layout.keep_last

    @property
    def last(self) -> Path | str:
        return self.name(self.layout.last)

    @property
    def best(self) -> Path | str:
        return self.name(self.layout.best)

    def step_path(self, step: int) -> Path | str:
        """The name of step ``step``'s periodic checkpoint."""
        return self.name(self.layout.step_path(step))

    def candidates(self) -> list[Path | str]:
        """What to resume from, newest first (:meth:`Layout.candidates`)."""
        return [self.name(path) for path in self.layout.candidates()]


def newest_readable(candidates: Iterable[Path],
                    read: Callable[[Path], dict[str, Any]]) -> dict[str, Any] | None:
    """``read`` of the first of ``candidates`` that reads; the unreadable ones before it are
    skipped with one warning line each. None when none reads."""
    for path in candidates:
        try:
            return read(path)
        except TrainkitError as err:
            log.warning("skipping unreadable checkpoint: %s", err)
    return None


def missing(path: str | Path, key: str) -> TrainkitError:
    """The error for a checkpoint ``path`` named by the setting ``key`` that does not exist."""
    return TrainkitError(f"checkpoint {path} does not exist: check {key}")


def unreadable(path: str | Path, err: BaseException) -> TrainkitError:
    """The error for a checkpoint whose bytes do not load (truncated, corrupt)."""
    return TrainkitError(f"checkpoint {path} cannot be read ({one_line(err, 80)})")


def write_failed(err: BaseException, directory: str | Path) -> TrainkitError:
    """The error for a save that failed; the storages leave every earlier checkpoint intact."""
    cause = err.strerror if isinstance(err, OSError) and err.strerror else one_line(err, 80)
    return TrainkitError(
        f"cannot write a checkpoint ({cause}); existing checkpoints are intact: free disk space "
        "or fix permissions, then re-run the same command to resume",
        details=[f"checkpoint folder: {directory}"])


def fsync_dir(directory: Path) -> None:
    """Make a rename or link in ``directory`` survive a power cut."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory; the rename is still done
        pass
    finally:
        os.close(fd)


def _link_target(link: Path) -> str | None:
    """The name a symlink ``link`` points at; None for a missing one or a plain file."""
    try:
        return os.readlink(link)
    except OSError:
        return None
