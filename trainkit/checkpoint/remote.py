"""Single-file checkpoints on object storage (any fsspec URL), where there is no rename.

``objects/<N>-<id>.pt`` holds a checkpoint's bytes under a name no reader takes for a
checkpoint; ``last.json``, ``best.json``, ``step_<N>.json`` are commit records naming an object
with its size and SHA-256 (the names and rotation are :mod:`~trainkit.checkpoint.layout`'s). A
save uploads the object, then writes ``best.json`` (when best), ``last.json`` -- the commit, one
PUT: visible whole or not at all -- and ``step_<N>.json``, then removes old records and every
object no record names. An object is read only through a record and checked against it, so a
kill at any moment leaves ``last.json`` naming a complete checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from trainkit.checkpoint.files import load_state, on_cpu
from trainkit.checkpoint.layout import (
    Layout,
    Named,
    missing,
    newest_readable,
    unreadable,
    write_failed,
)
from trainkit.core.errors import TrainkitError
from trainkit.core.objectstore import filesystem, join, store_error

FORMAT = "trainkit-object-1"
OBJECTS = "objects"
# Test-only: seconds to wait after a checkpoint's bytes are uploaded, before its commit record
# (here and in remote_sharded; tests/integration/test_object_storage and tests/dist/
# test_fsdp_object_storage kill runs inside that window).
UPLOAD_DELAY_ENV = "TRAINKIT_TEST_UPLOAD_DELAY_S"


class RemoteLayout(Layout):
    """:class:`~trainkit.checkpoint.layout.Layout` over an fsspec filesystem: the records are
    the names, and none is a link (``last.json`` and ``best.json`` are records of their own)."""

    def __init__(self, fs: Any, root: str, keep_last: int) -> None:
        super().__init__(root, keep_last, suffix=".json")
        self.fs = fs

    def entries(self) -> list[tuple[str, bool]]:
        root = str(self.directory)
        self.fs.invalidate_cache(root)  # listings are cached; another process may have written
        try:
            found = self.fs.ls(root, detail=True)
        except FileNotFoundError:
            return []
        return [(entry["name"].rstrip("/").rsplit("/", 1)[-1], entry["type"] == "directory")
                for entry in found]

    def _exists(self, path: Path) -> bool:
        return self.fs.exists(str(path))

    def _target(self, link: Path) -> str | None:
        return None


class RemoteCheckpoints(Named):
    """Saves checkpoints to ``url`` as objects and commit records, keeps the newest
    ``keep_last`` and finds one to resume from; the interface of
    :class:`~trainkit.checkpoint.files.CheckpointFiles` (the async writer drives either).

    Example:
        >>> ckpts = RemoteCheckpoints("s3://bucket/run", keep_last=3)  # doctest: +SKIP
        >>> ckpts.save(state, step=100)
        >>> state = ckpts.load_latest()
    """

    def __init__(self, url: str, keep_last: int = 3) -> None:
        self.url = url.rstrip("/")
        self.fs, root = filesystem(self.url, "checkpoint.dir")
        self.layout = RemoteLayout(self.fs, root, keep_last)

    def name(self, path: Path) -> str:
        """A record's URL, spelled as ``checkpoint.dir`` is (records lie at its top)."""
        return join(self.url, path.name)

    def check_writable(self) -> None:
        """Fail now, not hours into a run, when the store cannot be reached or written."""
        fs, _ = filesystem(self.url, "checkpoint.dir", quick=True)  # an answer in seconds
        probe = join(str(self.layout.directory), f"{OBJECTS}/.probe-{uuid.uuid4().hex[:8]}")
        try:
            fs.pipe(probe, b"")
            fs.rm(probe)
        except Exception as err:
            raise (store_error(err, self.url, "checkpoint.dir")
                   or write_failed(err, self.url)) from None

    def save(self, state: dict[str, Any], step: int, *, periodic: bool = True,
             best: bool = False) -> str:
        """Upload ``state``, commit it as ``last`` (and ``step_<step>`` when ``periodic``,
        ``best`` when ``best``), then rotate. Returns the record's URL.

        Raises:
            TrainkitError: the upload failed; every committed checkpoint is as it was.
        """
        try:
            return self._save(state, step, periodic=periodic, best=best)
        except Exception as err:
            raise (store_error(err, self.url, "checkpoint.dir")
                   or write_failed(err, self.url)) from None

    def _save(self, state: dict[str, Any], step: int, *, periodic: bool, best: bool) -> str:
        buffer = io.BytesIO()
        torch.save(on_cpu(state), buffer)
        data = buffer.getvalue()
        name = f"{OBJECTS}/{step:09d}-{uuid.uuid4().hex[:12]}.pt"
        self.fs.pipe(join(str(self.layout.directory), name), data)
        if delay := float(os.environ.get(UPLOAD_DELAY_ENV, 0) or 0):
            time.sleep(delay)
        record = json.dumps({"format": FORMAT, "global_step": step, "object": name,
                             "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        if best:  # before the commit: a kill between the two must not lose the best record
            self.fs.pipe(str(self.layout.best), record.encode())
        self.fs.pipe(str(self.layout.last), record.encode())  # the commit
        target = self.last
        if periodic:
            self.fs.pipe(str(self.layout.step_path(step)), record.encode())
            target = self.step_path(step)
            for old in self.layout.stale():
                self.fs.rm(str(old))
        remove_unnamed(self.fs, self.layout)  # one save is in flight at a time: none now
        return target

    def load_latest(self) -> dict[str, Any] | None:
        """The newest checkpoint that loads; an unreadable one is skipped with a warning."""
        return newest_readable(self.candidates(), read_committed)


def remove_unnamed(fs: Any, layout: RemoteLayout, *, recursive: bool = False) -> None:
    """Remove the objects (``recursive``: object folders) no commit record names: rotated ones,
    and uploads a kill left uncommitted. Only while no save is being written."""
    records = [layout.last, layout.best, *layout.steps()]
    named = {read_record(fs, str(path)).get("object") for path in records}
    objects = join(str(layout.directory), OBJECTS)
    fs.invalidate_cache(objects)
    try:
        present = fs.ls(objects, detail=False)
    except FileNotFoundError:
        return
    for path in present:
        if f"{OBJECTS}/{path.rstrip('/').rsplit('/', 1)[-1]}" not in named:
            fs.rm(path, recursive=recursive)


def read_record(fs: Any, path: str) -> dict[str, Any]:
    """The commit record at ``path``; {} where there is none or it is not one."""
    try:
        record = json.loads(fs.cat(path))
    except (FileNotFoundError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def read_committed(url: str, key: str = "checkpoint.resume") -> dict[str, Any]:
    """The checkpoint a commit record at ``url`` names, checked against its size and hash, with
    ``_path`` set to ``url``.

    Raises:
        TrainkitError: no such record, the store cannot be reached, or the object is missing,
            incomplete or not a checkpoint.
    """
    fs, path = filesystem(url, key)
    try:
        record = json.loads(fs.cat(path))
        data = fs.cat(join(path.rsplit("/", 1)[0], record["object"]))
    except FileNotFoundError as err:
        if not fs.exists(path):
            raise (store_error(err, url, key) or missing(url, key)) from None
        raise unreadable(url, err) from None
    except (ValueError, KeyError, TypeError) as err:
        raise TrainkitError(f"{url} is not a trainkit commit record ({err})") from None
    except Exception as err:
        raise (store_error(err, url, key) or unreadable(url, err)) from None
    if len(data) != record.get("bytes") or hashlib.sha256(data).hexdigest() != record.get(
            "sha256"):
        raise TrainkitError(f"checkpoint {url} is incomplete (its object's size or SHA-256 "
                            "differs from its record)")
    state = load_state(io.BytesIO(data), url)
    state["_path"] = url
    return state
