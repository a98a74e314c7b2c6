"""Sharded (FSDP, DCP) checkpoints on object storage (any fsspec URL), where there is no rename.

As :mod:`~trainkit.checkpoint.remote` keeps single files: ``objects/<N>-<id>/`` holds one
checkpoint's files (DCP's and ``trainkit.pt``) under a name no reader takes for a checkpoint, and
``last.json``, ``best.json``, ``step_<N>.json`` are commit records naming the folder and each
file with its size. Each rank writes its part with DCP's public ``FileSystemWriter`` into a local
staging folder (torch exports no fsspec writer: DCP's writer, planner and metadata stay as on a
disk, at the price of one local copy) and uploads it; after a barrier rank 0 writes
``best.json`` (when best), ``last.json`` -- the commit -- and ``step_<N>.json``, then removes
what no record names. Reading downloads every file of a checkpoint (a resharded load may need
any) and reads locally. With ``async_save`` the same steps run on trainkit's one background
writer: each rank's thread writes the staging folder (``dcp.save`` of a copy DCP's stager made),
uploads its files and joins a vote on the checkpoint's own gloo group (every rank uploaded
whole) before rank 0 writes the records. The loop waits only for the copy; a kill at any moment
still leaves the last commit whole.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainkit.checkpoint import sharded
from trainkit.checkpoint.async_writer import Background
from trainkit.checkpoint.files import save_atomic
from trainkit.checkpoint.layout import Named, missing, write_failed
from trainkit.checkpoint.remote import (
    OBJECTS,
    UPLOAD_DELAY_ENV,
    RemoteLayout,
    read_record,
    remove_unnamed,
)
from trainkit.core.errors import TrainkitError
from trainkit.core.objectstore import filesystem, join, store_error

log = logging.getLogger("trainkit")
FORMAT = "trainkit-sharded-object-1"
STAGING_PREFIX = "trainkit-dcp-"  # local folders (the system's temp dir, $TMPDIR)


class RemoteShardedCheckpoints(Named):
    """The interface of :class:`~trainkit.checkpoint.sharded.ShardedCheckpoints` over a URL.
    Every rank makes one at the same point (with ``async_save``, a collective: it makes a gloo
    group for the background saves) and calls :meth:`save` together."""

    def __init__(self, url: str, keep_last: int = 3, *, async_save: bool = False) -> None:
        self.url = url.rstrip("/")
        self.fs, root = filesystem(self.url, "checkpoint.dir")
        self.layout = RemoteLayout(self.fs, root, keep_last)
        self.distributed = sharded._distributed()
        self.is_main = not self.distributed or dist.get_rank() == 0
        self.async_save = async_save and self.distributed  # one process: DCP saves in place
        self.group = sharded._group(self.distributed, self.async_save)
        self.written_step = -1
        self._background = Background()

    in_flight = False  # a background save commits itself: nothing waits for poll()

    def name(self, path: Path) -> str:
        """A record's URL, spelled as ``checkpoint.dir`` is (records lie at its top)."""
        return join(self.url, path.name)

    def save(self, tensors: dict[str, Any], meta: dict[str, Any] | None, step: int, *,
             best: bool = False) -> None:
        """Write this rank's part of step ``step``; rank 0 commits it once every rank's part
        and DCP's metadata are uploaded (every rank calls this; ``meta`` matters on rank 0).
        With ``async_save`` it returns once the tensors are copied.

        Raises:
            TrainkitError: this (or the previous background) save failed; every committed
                checkpoint is as it was.
        """
        import torch.distributed.checkpoint as dcp

        self.wait()  # the previous save is committed: its objects are named, ours are not
        self.written_step = step
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX))
        try:
            name = self._same_on_every_rank(f"{OBJECTS}/{step:09d}-{uuid.uuid4().hex[:12]}")
            if self.is_main:
                save_atomic(meta or {}, staging / sharded.META_FILE)
            kwargs = {"storage_writer": sharded._writer(staging, step),
                      "process_group": self.group}
            if self.async_save:
                write = sharded.staged_save(tensors, **kwargs)
                self._background.start(lambda: self._in_background(
                    write, staging, name, step, best), step)
                return
            with sharded._quiet_single_process():
                dcp.save(tensors, no_dist=not self.distributed, **kwargs)
            self._publish(staging, name, step, best)
        except (OSError, dcp.CheckpointException) as err:
            shutil.rmtree(staging, ignore_errors=True)
            raise write_failed(err, self.url) from None
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def _in_background(self, write: Callable[[], None], staging: Path, name: str, step: int,
                       best: bool) -> None:
        """An async save on the background writer: DCP's write of the staged copy, then the
        upload and the commit; an error is raised by :meth:`wait`."""
        try:
            try:
                write()
            except Exception as err:
                raise write_failed(err, self.url) from None
            self._publish(staging, name, step, best)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def _publish(self, staging: Path, name: str, step: int, best: bool) -> None:
        """Upload this rank's files; once every rank's are in the store, rank 0 commits."""
        try:
            uploaded = self._attempt(lambda: self._upload(staging, name))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if delay := float(os.environ.get(UPLOAD_DELAY_ENV, 0) or 0):
            time.sleep(delay)  # test-only: a window between the upload and the commit
        if not self._every_rank(uploaded is None):
            raise uploaded or TrainkitError(
                f"cannot write a checkpoint to {self.url}: another rank's upload failed; "
                "existing checkpoints are intact")
        if self.is_main:
            self._guard(lambda: self._commit(name, step, best))

    def _attempt(self, write: Any) -> TrainkitError | None:
        """``write``'s error as one line, or None: returned, not raised, so that a rank whose
        upload failed still joins the vote and no rank waits for it."""
        try:
            self._guard(write)
        except TrainkitError as err:
            return err
        return None

    def _every_rank(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (a collective on the checkpoint's group)."""
        if not self.distributed:
            return ok
        flag = torch.tensor([int(ok)], dtype=torch.uint8)  # on the CPU: a gloo group
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def wait(self) -> None:
        """Block until a background save is committed; raise its error."""
        self._background.wait()

    def close(self) -> None:
        """Like :meth:`wait`, but an error is logged, not raised (the exit already fails)."""
        self._background.close()

    def update_meta(self, meta: dict[str, Any] | None, step: int, *, best: bool) -> None:
        """Give step ``step``'s checkpoint (this run's newest) a new ``trainkit.pt``: uploaded
        under a new name, then the records naming the checkpoint rewritten to name it."""
        self.wait()  # the checkpoint is committed before its records are rewritten
        if not self.is_main:
            return
        self._guard(lambda: self._replace_meta(meta or {}, step, best))

    def _replace_meta(self, meta: dict[str, Any], step: int, best: bool) -> None:
        record = read_record(self.fs, str(self.layout.last))
        base = join(str(self.layout.directory), record["object"])
        new = f"trainkit-{uuid.uuid4().hex[:8]}.pt"
        with tempfile.TemporaryDirectory(prefix=STAGING_PREFIX) as staging:
            save_atomic(meta, Path(staging) / new)
            self.fs.put_file(str(Path(staging) / new), join(base, new))
            size = (Path(staging) / new).stat().st_size
        old = record["meta"]
        files = {k: v for k, v in record["files"].items() if k != old} | {new: size}
        record = {**record, "meta": new, "files": files}
        numbered = self.fs.exists(str(self.layout.step_path(step)))  # rewritten too, if any
        self._write_records(record, step, periodic=numbered, best=best)
        self.fs.rm(join(base, old))  # no record names it now

    def poll(self) -> None:
        pass

    def _same_on_every_rank(self, name: str) -> str:
        """Rank 0's ``name``, on every rank (a collective)."""
        if not self.distributed:
            return name
        names = [name]
        dist.broadcast_object_list(names, src=0, group=self.group)
        return names[0]

    def _upload(self, staging: Path, name: str) -> None:
        base = join(str(self.layout.directory), name)
        for path in sorted(staging.iterdir()):
            if path.is_file():
                self.fs.put_file(str(path), join(base, path.name))

    def _commit(self, name: str, step: int, best: bool) -> None:
        """Rank 0, after every rank uploaded: the records naming ``name``, then the rotation."""
        base = join(str(self.layout.directory), name)
        self.fs.invalidate_cache(base)
        files = {entry["name"].rsplit("/", 1)[-1]: entry["size"]
                 for entry in self.fs.ls(base, detail=True) if entry["type"] == "file"}
        if ".metadata" not in files:
            raise OSError(f"{base} has no .metadata after every rank's upload")
        record = {"format": FORMAT, "global_step": step, "object": name,
                  "meta": sharded.META_FILE, "files": files}
        self._write_records(record, step, periodic=True, best=best)

    def _write_records(self, record: dict[str, Any], step: int, *, periodic: bool,
                       best: bool) -> None:
        data = json.dumps(record).encode()
        if best:  # before the commit: a kill between the two must not lose the best record
            self.fs.pipe(str(self.layout.best), data)
        self.fs.pipe(str(self.layout.last), data)  # the commit
        if periodic:
            self.fs.pipe(str(self.layout.step_path(step)), data)
            for old in self.layout.stale():
                self.fs.rm(str(old))
        # every rank is past its upload: none is being written now
        remove_unnamed(self.fs, self.layout, recursive=True)

    def _guard(self, write: Any) -> Any:
        try:
            return write()
        except Exception as err:
            raise (store_error(err, self.url, "checkpoint.dir")
                   or write_failed(err, self.url)) from None


def is_sharded_record(url: str) -> bool:
    """Whether ``url`` is a commit record of a sharded checkpoint (False where none reads)."""
    try:
        fs, path = filesystem(url, "checkpoint")
        return read_record(fs, path).get("format") == FORMAT
    except Exception:  # the reader of the other format says what is wrong
        return False


def read_meta(url: str, *, key: str = "checkpoint.resume") -> dict[str, Any]:
    """:func:`~trainkit.checkpoint.sharded.read_meta` of the checkpoint the record at ``url``
    names, downloaded whole into a local folder: ``_path`` is ``url``, ``_files`` the folder
    (DCP reads it; :func:`forget` removes it).

    Raises:
        TrainkitError: no such record, the store cannot be reached, or the checkpoint is
            missing, incomplete or not one.
    """
    fs, path = filesystem(url, key)
    try:
        record = json.loads(fs.cat(path))
        base = join(path.rsplit("/", 1)[0], record["object"])
        files, meta_name = dict(record["files"]), record["meta"]
    except FileNotFoundError as err:
        raise (store_error(err, url, key) or missing(url, key)) from None
    except (ValueError, KeyError, TypeError) as err:
        raise TrainkitError(f"{url} is not a trainkit commit record ({err})") from None
    except Exception as err:
        raise (store_error(err, url, key) or TrainkitError(f"cannot read {url} ({err})")) from None
    local = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX))
    try:
        for name, size in files.items():
            target = local / (sharded.META_FILE if name == meta_name else name)
            fs.get_file(join(base, name), str(target))
            if target.stat().st_size != size:
                raise TrainkitError(f"checkpoint {url} is incomplete ({name} is "
                                    f"{target.stat().st_size} bytes, its record says {size})")
        meta = sharded.read_meta(local, key=key)
    except Exception as err:
        shutil.rmtree(local, ignore_errors=True)
        if isinstance(err, TrainkitError):
            raise TrainkitError(str(err).replace(str(local), url)) from None
        raise (store_error(err, url, key)
               or TrainkitError(f"checkpoint {url} is incomplete ({err})")) from None
    meta["_path"], meta["_files"] = url, str(local)
    return meta


def forget(meta: dict[str, Any]) -> None:
    """Remove the local copy :func:`read_meta` made (nothing for a checkpoint on a disk)."""
    if meta.get("_files"):
        shutil.rmtree(meta["_files"], ignore_errors=True)
