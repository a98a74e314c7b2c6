"""Where checkpoints are kept, apart from how they are written: a folder on a disk or a store.

A location knows how a checkpoint becomes visible there and how its names are found:

- :class:`LocalFolder`: a checkpoint is written under a hidden name, fsynced and renamed into
  place; ``last``/``best`` are links (hard links to a file, symlinks to a directory).
- :class:`StoreFolder` (any fsspec URL): there is no rename; a checkpoint's bytes go to an
  object no reader takes for one, then a commit record (``last.json``, ``step_<N>.json``)
  names it; a sharded save commits only after every rank's upload vote.

The two formats -- one file (:mod:`~trainkit.checkpoint.files`) and DCP shards
(:mod:`~trainkit.checkpoint.sharded`) -- meet the two locations in this module alone: the
table of :meth:`~LocalFolder.files` and :meth:`~LocalFolder.shards` gives the writer of each pair,
:func:`read_file` and :func:`read_shards` the reader. :func:`checkpoint_folder` picks the
location of a ``checkpoint.dir`` (or a run's ``checkpoints/``) once.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from trainkit.checkpoint import remote, remote_sharded, sharded
from trainkit.checkpoint.files import CheckpointFiles, read_file_checkpoint
from trainkit.checkpoint.layout import Layout
from trainkit.core.location import locate
from trainkit.core.objectstore import filesystem, join

_NAME = re.compile(r"^(last|best|step_(\d+))(\.pt|\.json)?$")


class LocalFolder:
    """Checkpoints in a folder on a disk (atomic renames, fsynced, ``last``/``best`` links)."""

    is_store = False

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def __str__(self) -> str:
        return str(self.directory)

    def files(self, keep_last: int) -> CheckpointFiles:
        """The writer of one-file checkpoints here."""
        return CheckpointFiles(self.directory, keep_last)

    def shards(self, keep_last: int, *, async_save: bool) -> sharded.ShardedCheckpoints:
        """The writer of sharded (DCP) checkpoints here: a collective (every rank makes one)."""
        return sharded.ShardedCheckpoints(self.directory, keep_last, async_save=async_save)

    def sharded_candidates(self) -> list[Path | str]:
        """The sharded checkpoints here to resume from, newest first (no writer needed)."""
        return list(Layout(self.directory, suffix="").candidates())

    def check_writable(self) -> None:
        """Fail now, not hours into a run, when checkpoints cannot be written here."""
        CheckpointFiles(self.directory).check_writable()

    def available(self) -> dict[str, Path | str]:
        """``{"last": ..., "best": ..., "step_<N>": ...}`` of the checkpoints here (either
        format; leftovers of unfinished saves, ``.*.tmp``, are none)."""
        if not self.directory.is_dir():
            return {}
        found: dict[str, Path | str] = {}
        for path in self.directory.iterdir():
            if path.name.startswith(".") or not path.exists():
                continue
            if (key := _key(path.name, ".pt")) is not None:
                found[key] = path
        return found


class StoreFolder:
    """Checkpoints at an fsspec URL: objects and the commit records that name them."""

    is_store = True

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def __str__(self) -> str:
        return self.url

    def files(self, keep_last: int) -> remote.RemoteCheckpoints:
        return remote.RemoteCheckpoints(self.url, keep_last)

    def shards(self, keep_last: int, *,
               async_save: bool) -> remote_sharded.RemoteShardedCheckpoints:
        return remote_sharded.RemoteShardedCheckpoints(self.url, keep_last,
                                                        async_save=async_save)

    def sharded_candidates(self) -> list[Path | str]:
        return []  # a run at a URL lists the records of its own format only

    def check_writable(self) -> None:
        """Fail now when the store cannot be reached or written (an answer in seconds)."""
        remote.RemoteCheckpoints(self.url).check_writable()

    def available(self) -> dict[str, Path | str]:
        """The commit records here by name (``last``, ``best``, ``step_<N>``), as URLs."""
        fs, root = filesystem(self.url, "checkpoint.dir")
        layout = remote.RemoteLayout(fs, root, keep_last=1)
        return {key: join(self.url, name) for name, is_dir in layout.entries()
                if not is_dir and (key := _key(name, ".json")) is not None}


Folder = LocalFolder | StoreFolder


def checkpoint_folder(directory: str | Path) -> Folder:
    """The location of ``directory``: a folder on this disk or a store's URL."""
    where = locate(directory)
    return StoreFolder(where) if isinstance(where, str) else LocalFolder(where)


def checkpoint_path(name: str | Path) -> Path | str:
    """One checkpoint's name (``checkpoint.resume``, ``ckpt=``) as the readers take it: a commit
    record's URL as a string, a file or directory as a Path."""
    return locate(name)


def is_sharded_checkpoint(checkpoint: Path | str) -> bool:
    """Whether ``checkpoint`` (a :func:`checkpoint_path`) is a sharded one: a directory, or a
    record of a sharded checkpoint in a store (False where none reads)."""
    if isinstance(checkpoint, str):
        return remote_sharded.is_sharded_record(checkpoint)
    return checkpoint.is_dir()


def read_file(path: Path | str, key: str) -> dict[str, Any]:
    """A one-file checkpoint at ``path`` (a file, or a commit record's URL), ``_path`` set."""
    if isinstance(path, str):
        return remote.read_committed(path, key)
    return read_file_checkpoint(path, key)


def read_shards(path: Path | str, key: str) -> dict[str, Any]:
    """The non-tensor part of a sharded checkpoint (a directory, or a record's URL: downloaded
    into a local folder, ``_files``, removed by :func:`~trainkit.checkpoint.remote_sharded.
    forget`), checked whole."""
    if isinstance(path, str):
        return remote_sharded.read_meta(path, key=key)
    return sharded.read_meta(path, key=key)


def _key(name: str, suffix: str) -> str | None:
    """``last``, ``best`` or ``step_<N>`` (unpadded) for a checkpoint's file, directory or record
    name; None for any other name."""
    match = _NAME.match(name)
    if match is None or match.group(3) not in (None, suffix):
        return None
    return f"step_{int(match.group(2))}" if match.group(2) else match.group(1)
