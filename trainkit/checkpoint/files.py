"""Single-file checkpoints that survive crashes: atomic writes, rotation after durability, safe
loading.

Layout inside ``<run>/checkpoints``: ``step_<global_step>.pt`` for periodic saves, ``last.pt``,
always the newest complete checkpoint, and ``best.pt``, the best by ``checkpoint.monitor`` (kept
apart from the rotation). A file being written is named ``.<name>.tmp`` and only renamed to its
``.pt`` name after its bytes are on disk.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from trainkit.errors import TrainkitError, one_line
from trainkit.tree import tree_map

log = logging.getLogger("trainkit")
_STEP_FILE = re.compile(r"^step_(\d+)\.pt$")


def save_atomic(state: dict[str, Any], path: str | Path) -> Path:
    """Write ``state`` with ``torch.save`` so that ``path`` is either the old file or the new one.

    Writes to a temporary name in the same folder, flushes and fsyncs it, renames it over
    ``path`` (atomic on POSIX), then fsyncs the folder so the rename itself survives a power cut.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    state = _on_cpu(state)
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
    _fsync_dir(path.parent)
    return path


def _on_cpu(state: dict[str, Any]) -> dict[str, Any]:
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
        raise TrainkitError(f"checkpoint {path} does not exist: check {key}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise TrainkitError(f"checkpoint {path} cannot be read ({one_line(err)})") from None
    if not isinstance(state, dict) or "model" not in state or "global_step" not in state:
        raise TrainkitError(f"{path} is not a trainkit checkpoint (no 'model'/'global_step' keys)")
    return state


class CheckpointManager:
    """Saves numbered checkpoints, keeps the newest ``keep_last``, and finds one to resume from.

    Example:
        >>> ckpts = CheckpointManager("runs/a/checkpoints", keep_last=3)  # doctest: +SKIP
        >>> ckpts.save(state, step=100)
        >>> state = ckpts.load_latest()
    """

    def __init__(self, directory: str | Path, keep_last: int = 3) -> None:
        self.directory = Path(directory)
        self.keep_last = keep_last

    @property
    def last(self) -> Path:
        return self.directory / "last.pt"

    @property
    def best(self) -> Path:
        return self.directory / "best.pt"

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
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir()
                 if (m := _STEP_FILE.match(p.name))]
        return [p for _, p in sorted(found)]

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
            raise TrainkitError(
                f"cannot write a checkpoint ({err.strerror or one_line(err, 60)}); existing "
                "checkpoints are intact: free disk space or fix permissions, then re-run the same "
                "command to resume", details=[f"checkpoint folder: {self.directory}"]
            ) from None

    def _save(self, state: dict[str, Any], step: int, *, periodic: bool, best: bool) -> Path:
        target = save_atomic(state, self.last)
        if best:
            _link_or_copy(self.last, self.best)
        if periodic:
            numbered = self.directory / f"step_{step:09d}.pt"
            _link_or_copy(self.last, numbered)
            target = numbered
            # Only now that the new file is durable may old ones go.
            for old in self.step_files()[: -self.keep_last]:
                old.unlink(missing_ok=True)
        return target

    def candidates(self) -> list[Path]:
        """Files to try when resuming, newest first."""
        files = list(reversed(self.step_files()))
        if self.last.is_file():
            files.insert(0, self.last)
        return files

    def load_latest(self) -> dict[str, Any] | None:
        """The newest checkpoint that loads; an unreadable one is skipped with a warning."""
        for path in self.candidates():
            try:
                state = load_checkpoint(path)
            except TrainkitError as err:
                log.warning("skipping unreadable checkpoint: %s", err)
                continue
            state["_path"] = str(path)
            return state
        return None


def _link_or_copy(src: Path, dst: Path) -> None:
    """Give ``src``'s bytes a second name atomically: a hard link when the filesystem allows."""
    tmp = dst.with_name(f".{dst.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        try:
            os.link(src, tmp)
        except OSError:  # filesystems without hard links
            import shutil

            shutil.copyfile(src, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(dst.parent)


def _fsync_dir(directory: Path) -> None:
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
