"""Single-file checkpoints that survive crashes: atomic writes, rotation after durability, safe
loading.

The names are :mod:`~trainkit.checkpoint.layout`'s with the suffix ``.pt``: ``step_<N>.pt`` for
periodic saves, ``last.pt``, always the newest complete checkpoint, and ``best.pt``, the best by
``checkpoint.monitor`` (kept apart from the rotation); the extra names are hard links to the
same bytes. A file being written is named ``.<name>.tmp`` and only renamed to its ``.pt`` name
after its bytes are on disk.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from trainkit.checkpoint.layout import (
    Layout,
    Named,
    fsync_dir,
    missing,
    newest_readable,
    tmp_path,
    unreadable,
    write_failed,
)
from trainkit.core.errors import TrainkitError, one_line
from trainkit.core.tree import tree_map


def save_atomic(state: dict[str, Any], path: str | Path) -> Path:
    """Write ``state`` with ``torch.save`` so that ``path`` is either the old file or the new one.

    Writes to a temporary name in the same folder, flushes and fsyncs it, renames it over
    ``path`` (atomic on POSIX), then fsyncs the folder so the rename itself survives a power cut.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(path)
    state = on_cpu(state)
    try:
        with open(tmp, "wb") as f:
            try:
                torch.save(state, f)
            except RuntimeError as err:
                # torch's writer reports a failed write (disk full, file too large) as its own
                # RuntimeError; the OSError behind it says what happened.
                if isinstance(err.__context__, OSError):
                    raise err.__context__ from None
                raise
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def on_cpu(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its device tensors copied to the CPU, as the async path's snapshot has them.

    ``torch.save`` keeps each tensor's device in the file: a file saved from ``cuda:1`` then needs
    ``map_location`` to load where there is no second GPU (or none). torch.save copies each
    storage to the host anyway; here it happens first. A tensor met twice (tied weights) is
    copied once, so the file keeps them one.
    """
    copies: dict[int, torch.Tensor] = {}

    def host(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "cpu":
            return tensor
        if id(tensor) not in copies:
            copies[id(tensor)] = tensor.detach().to("cpu")
        return copies[id(tensor)]

    return tree_map(host, state)


def load_checkpoint(path: str | Path, *, key: str = "checkpoint.resume") -> dict[str, Any]:
    """Load a checkpoint on the CPU with ``weights_only=True``: a pickle that would run code is
    refused, not executed. ``key``: the setting that named the file, for the messages.

    Raises:
        TrainkitError: the file is missing, truncated, corrupt or not a trainkit checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise missing(path, key)
    return load_state(path, path)


def load_state(source: Any, path: str | Path) -> dict[str, Any]:
    """``torch.load`` of ``source`` (a file name or a stream) with ``weights_only=True``, checked
    to be a trainkit checkpoint; ``path`` names it in the messages."""
    try:
        state = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as err:
        raise unreadable(path, err) from None
    if not isinstance(state, dict) or "model" not in state or "global_step" not in state:
        raise TrainkitError(f"{path} is not a trainkit checkpoint (no 'model'/'global_step' keys)")
    return state


class CheckpointFiles(Named):
    """Checkpoint files of your own loop in one folder: saves any dict of state (several models
    and optimizers by name, a step counter, ...) atomically as ``last.pt`` and ``step_<N>.pt``,
    keeps the newest ``keep_last``, and loads the newest back. The Trainer's single-file storage
    writes through one too.

    ``required``: the keys :meth:`load_latest` needs in a file (e.g. ``("g", "d", "step")``);
    a newest file without them is an error naming them, not a silent start from scratch.

    Example:
        >>> ckpts = CheckpointFiles("runs/a/checkpoints", keep_last=3,
        ...                         required=("g", "d", "step"))  # doctest: +SKIP
        >>> ckpts.save({"g": g.state_dict(), "d": d.state_dict(), "step": 7}, step=7)
        >>> state = ckpts.load_latest()   # None in an empty folder
    """

    def __init__(self, directory: str | Path, keep_last: int = 3, *,
                 required: Iterable[str] = ()) -> None:
        self.layout = Layout(directory, keep_last, suffix=".pt")
        self.directory = self.layout.directory
        self.required = tuple(required)

    def check_writable(self) -> None:
        """Fail now, not hours into a run, when checkpoints could not be written here."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.directory):
                pass
        except OSError as err:
            raise TrainkitError(
                f"cannot write checkpoints ({err.strerror or one_line(err, 60)}): choose a "
                "writable run_dir or fix the folder's permissions",
                details=[f"checkpoint folder: {self.directory}"]) from None

    def step_files(self) -> list[Path]:
        """Periodic checkpoints, oldest first."""
        return self.layout.steps()

    def save(self, state: dict[str, Any], step: int, *, periodic: bool = True,
             best: bool = False) -> Path:
        """Write ``last.pt`` (and ``step_<step>.pt`` when ``periodic``, ``best.pt`` when ``best``),
        then rotate old periodic ones. The extra names are hard links to the same bytes.

        Raises:
            TrainkitError: the file could not be written (disk full, read-only folder); every
                existing checkpoint is left as it was.
        """
        try:
            return self._save(state, step, periodic=periodic, best=best)
        except OSError as err:
            raise write_failed(err, self.directory) from None

    def _save(self, state: dict[str, Any], step: int, *, periodic: bool, best: bool) -> Path:
        target = save_atomic(state, self.last)
        if best:
            _link_or_copy(self.last, self.best)
        if periodic:
            numbered = self.layout.step_path(step)
            _link_or_copy(self.last, numbered)
            target = numbered
            # Only now that the new file is durable may old ones go.
            for old in self.layout.stale():
                old.unlink(missing_ok=True)
        return target

    def load_latest(self, required: Iterable[str] | None = None) -> dict[str, Any] | None:
        """The newest checkpoint that loads (an unreadable one, cut short or corrupt, is skipped
        with a warning line); None when the folder has none. ``required``: the keys it must
        hold (default: the constructor's).

        Raises:
            TrainkitError: the newest readable file lacks a required key (one line naming them).
        """
        state = newest_readable(self.candidates(), read_state_file)
        if state is None:
            return None
        wanted = self.required if required is None else tuple(required)
        if lacking := [key for key in wanted if key not in state]:
            held = ", ".join(sorted(str(key) for key in state if not str(key).startswith("_")))
            raise TrainkitError(
                f"checkpoint {state['_path']} cannot be resumed: it has no "
                f"{', '.join(map(repr, lacking))} (it holds {held}): resume from a checkpoint "
                "this loop saved, or start in another folder")
        return state


# The name before round seven, kept so that scripts written against it run unchanged.
CheckpointManager = CheckpointFiles


def read_state_file(path: Path) -> dict[str, Any]:
    """Any dict saved by :class:`CheckpointFiles` (``torch.load`` with ``weights_only=True``),
    with ``_path`` set.

    Raises:
        TrainkitError: the file is missing, cut short or corrupt, or holds no dict.
    """
    if not Path(path).is_file():
        raise missing(path, "checkpoint")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise unreadable(path, err) from None
    if not isinstance(state, dict):
        raise TrainkitError(f"{path} holds a {type(state).__name__}, not a dict of state")
    state["_path"] = str(path)
    return state


def read_file_checkpoint(path: Path, key: str = "checkpoint.resume") -> dict[str, Any]:
    """:func:`load_checkpoint`, with the path it came from as ``_path`` (for messages)."""
    state = load_checkpoint(path, key=key)
    state["_path"] = str(path)
    return state


def _link_or_copy(src: Path, dst: Path) -> None:
    """Give ``src``'s bytes a second name atomically: a hard link when the filesystem allows."""
    tmp = tmp_path(dst)
    tmp.unlink(missing_ok=True)
    try:
        try:
            os.link(src, tmp)
        except OSError:  # filesystems without hard links
            shutil.copyfile(src, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(dst.parent)
