"""Sharded checkpoints of FSDP2 runs: one directory per save, every rank writing its own part.

``step_<N>/`` holds DCP's shard files and ``.metadata`` for the model, optimizer and EMA weights
(keyed by parameter name: reshardable onto any number of ranks) and ``trainkit.pt``, everything
else, loadable with ``weights_only=True``. ``last`` and ``best`` are relative symlinks, each
replaced atomically; the names and rotation are :mod:`~trainkit.checkpoint.layout`'s. A save is
visible only when whole: the ranks write fsynced files into ``.step_<N>.tmp/`` (never resumed
from; the next save removes it), DCP writes ``.metadata`` once every part is in, then rank 0
renames it to ``step_<N>``, fsyncs the folder, points ``last`` at it and rotates (layout:
docs/distributed.md, "What a checkpoint directory holds"). With ``async_save`` the tensors are
copied by DCP's public stager and ``dcp.save`` runs on trainkit's one background writer
(:class:`~trainkit.checkpoint.async_writer.Background`), as every other save in the background.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trainkit.checkpoint.async_writer import Background
from trainkit.checkpoint.files import save_atomic
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
from trainkit.distributed.group import barrier

if TYPE_CHECKING:  # imported where used: with FSDP and sympy it costs ~0.8 s at start-up
    import torch.distributed.checkpoint as dcp

log = logging.getLogger("trainkit")
META_FILE = "trainkit.pt"  # the non-tensor part, next to DCP's files
FORMAT = "trainkit-sharded-1"
# Test-only: "STEP:RANK" makes that rank SIGKILL itself inside the write of that step, after its
# shard file is written and before DCP's metadata exists (tests/dist/test_sharded_checkpoints).
KILL_IN_WRITE_ENV = "TRAINKIT_TEST_KILL_IN_CHECKPOINT_WRITE"


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it assumes a single process when there is no process group: we know."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class ShardedCheckpoints(Named):
    """Writes ``step_<N>/`` directories through DCP, rotates them, and finds one to resume from.

    Every rank makes one, at the same point (with ``async_save`` it makes a gloo group for
    DCP's collectives), and calls :meth:`save` together; rank 0 alone renames, links and
    rotates.

    Example:
        >>> ckpts = ShardedCheckpoints("runs/a/checkpoints", keep_last=3)  # doctest: +SKIP
        >>> ckpts.save(tensors, meta, step=100)  # tensors: DCP state; meta: rank 0's extras
    """

    def __init__(self, directory: str | Path, keep_last: int = 3, *,
                 async_save: bool = False) -> None:
        self.layout = Layout(directory, keep_last, suffix="")
        self.directory = self.layout.directory
        self.async_save = async_save
        self.distributed = _distributed()
        self.is_main = not self.distributed or dist.get_rank() == 0
        self.group = _group(self.distributed, async_save)
        self._background = Background()  # the one background writer (async_writer.py)
        self._pending: tuple[int, bool] | None = None  # an async save's step and best
        self.written_step = -1  # the step this process last wrote its part of (not a file test)

    # -- saving -------------------------------------------------------------------------------

    def save(self, tensors: dict[str, Any], meta: dict[str, Any] | None, step: int, *,
             best: bool = False) -> None:
        """Write ``step_<step>/`` (every rank calls this; ``meta`` matters on rank 0 only).

        With ``async_save`` this returns once the tensors are copied (:func:`staged_save`); the
        directory gets its name, ``last`` and the rotation when the write has ended on every
        rank (at the next save, :meth:`wait` or :meth:`poll`).

        Raises:
            TrainkitError: this or the previous write failed; earlier checkpoints are intact.
        """
        import torch.distributed.checkpoint as dcp

        self.wait()
        tmp, self.written_step = tmp_path(self.layout.step_path(step)), step
        if self.is_main:
            self._guard(lambda: self._clear_leftovers(tmp))
            self._guard(lambda: save_atomic(meta or {}, tmp / META_FILE))
        self._barrier()  # the folder exists, empty of a dead save's files, before anyone writes
        kwargs = {"storage_writer": _writer(tmp, step), "process_group": self.group}
        if self.async_save and self.distributed:
            write = self._guard(lambda: staged_save(tensors, **kwargs))
            self._background.start(write, step)
            self._pending = (step, best)
            return
        with _quiet_single_process():
            self._guard(lambda: dcp.save(tensors, no_dist=not self.distributed, **kwargs))
        self._publish(step, best)

    def update_meta(self, meta: dict[str, Any] | None, step: int, *, best: bool) -> None:
        """Rewrite ``trainkit.pt`` of ``step_<step>/`` (written already: its tensors are the
        same), and point ``best`` at it when ``best``."""
        self.wait()
        if self.is_main:
            target = self.layout.step_path(step)
            self._guard(lambda: save_atomic(meta or {}, target / META_FILE))
            if best:
                self._guard(lambda: _point(self.best, target))

    @property
    def in_flight(self) -> bool:
        """Whether an async save is written or waits for :meth:`poll` to publish it."""
        return self._pending is not None

    def poll(self) -> None:
        """Publish an async save that has ended (cheap when none has: asks its thread)."""
        if self._pending is not None and self._background.done:
            self.wait()

    def wait(self) -> None:
        """Block until an async save in flight is on disk and published; raise its error."""
        if self._pending is None:
            return
        step, best = self._pending
        self._pending = None
        self._guard(self._background.wait)
        self._publish(step, best)

    def close(self) -> None:
        """Like :meth:`wait`, but an error is logged, not raised (the exit already fails)."""
        try:
            self.wait()
        except Exception as err:  # the error already being raised matters more
            log.error("the last checkpoint write failed too: %s", one_line(err))

    def _publish(self, step: int, best: bool) -> None:
        """Rank 0: the written directory takes its name, then ``last`` (and ``best``) point at
        it, then old directories go -- each only after the one before is durable."""
        if not self.is_main:
            return
        target = self.layout.step_path(step)
        self._guard(lambda: self._rename_into_place(tmp_path(target), target))
        self._guard(lambda: _point(self.last, target))
        if best:
            self._guard(lambda: _point(self.best, target))
        self._rotate()

    def _rename_into_place(self, tmp: Path, target: Path) -> None:
        fsync_dir(tmp)
        if target.exists():  # a re-save of this step (a resumed run passing it again)
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        fsync_dir(self.directory)

    def _rotate(self) -> None:
        """Keep the newest ``keep_last`` directories, and whatever ``last``/``best`` name."""
        for old in self.layout.stale():
            shutil.rmtree(old, ignore_errors=True)

    def _clear_leftovers(self, tmp: Path) -> None:
        """Remove folders of saves that died (one save is in flight at a time: none is ours),
        then make ``tmp``, empty."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for path in self.layout.leftovers():
            shutil.rmtree(path, ignore_errors=True)
        tmp.mkdir()

    def _barrier(self) -> None:
        if self.distributed:  # on the CPU: dist.barrier on a GPU-bound group runs NCCL's
            barrier(self.group)

    def _guard(self, write: Any) -> Any:
        """Run ``write``; an OSError or DCP's error becomes one line, earlier ones intact."""
        from torch.distributed.checkpoint import CheckpointException

        try:
            return write()
        except (OSError, CheckpointException) as err:
            raise write_failed(err, self.directory) from None

# -- finding one to resume from -------------------------------------------------------------


def staged_save(tensors: dict[str, Any], **kwargs: Any) -> Callable[[], None]:
    """A copy of ``tensors`` on the CPU (DCP's public stager, as ``dcp.async_save`` makes it:
    DTensors stay DTensors), and the ``dcp.save`` of that copy (``kwargs``: its arguments) to
    run on the background writer. The loop may change the tensors once this returns."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=False))
    try:
        copy = stager.stage(tensors)
    except BaseException:
        stager.close()
        raise

    def write() -> None:
        try:  # in a process group (async saves are): no single-process warning to quiet
            dcp.save(copy, **kwargs)
        finally:
            stager.close()  # its copies' memory

    return write


def latest_meta(directory: str | Path) -> dict[str, Any] | None:
    """The non-tensor part of the newest complete directory in ``directory`` (``last``'s
    first); broken ones are skipped with one warning line each. Reads only: no collective."""
    return newest_readable(Layout(directory, suffix="").candidates(), read_meta)


def _group(distributed: bool, async_save: bool) -> Any:
    """The process group DCP's collectives run on (None: the default one).

    An async save runs them on a background thread while training goes on: on a gloo group of
    their own, so they never interleave with training's (made here, a collective: every rank
    constructs a :class:`ShardedCheckpoints` at the same point). Otherwise the CPU group.
    """
    if not distributed:
        return None
    if async_save:
        return dist.new_group(backend="gloo")
    from trainkit.distributed.group import _cpu_group

    return _cpu_group()


def _point(link: Path, target: Path) -> None:
    """Make ``link`` a relative symlink to ``target``, replacing an old one atomically."""
    tmp = tmp_path(link)
    tmp.unlink(missing_ok=True)
    os.symlink(target.name, tmp)
    os.replace(tmp, link)
    fsync_dir(link.parent)


# -- reading --------------------------------------------------------------------------------


def read_meta(path: str | Path, *, key: str = "checkpoint.resume") -> dict[str, Any]:
    """The ``trainkit.pt`` of a checkpoint directory, after checking that the directory is whole:
    DCP's metadata reads and every file it names is there at its full length.

    Raises:
        TrainkitError: missing, not a checkpoint directory, incomplete or corrupt.
    """
    path = Path(path)
    if not path.exists():
        raise missing(path, key)
    if (path / "last").is_symlink() or (path / "last.pt").is_file():
        last = "last" if (path / "last").is_symlink() else "last.pt"  # the one that exists
        raise TrainkitError(f"{path} is a checkpoints folder: give one of its checkpoints, "
                            f"e.g. {path / last}")
    if not (path / ".metadata").is_file() or not (path / META_FILE).is_file():
        raise TrainkitError(f"{path} is not a complete sharded checkpoint (no .metadata or "
                            f"{META_FILE}: an unfinished save, or another folder)")
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = torch.load(path / META_FILE, map_location="cpu", weights_only=True)
        storage = FileSystemReader(path).read_metadata()
    except Exception as err:
        raise unreadable(path, err) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise TrainkitError(f"{path} is not a trainkit sharded checkpoint ({META_FILE} has no "
                            f"format {FORMAT!r})")
    for info in (storage.storage_data or {}).values():
        file = path / getattr(info, "relative_path", "")
        end = getattr(info, "offset", 0) + getattr(info, "length", 0)
        if not file.is_file() or file.stat().st_size < end:
            raise TrainkitError(f"checkpoint {path} is incomplete ({file.name} is missing or "
                                "truncated)")
    meta["_path"] = str(path)
    meta["_tensors"] = storage.state_dict_metadata
    return meta


def _writer(tmp: Path, step: int) -> dcp.FileSystemWriter:
    """DCP's writer with fsynced files; the test-only killing one where the test asked."""
    from torch.distributed.checkpoint import FileSystemWriter

    rank = dist.get_rank() if _distributed() else 0
    if os.environ.get(KILL_IN_WRITE_ENV, "") != f"{step}:{rank}":
        return FileSystemWriter(tmp, sync_files=True)

    class KilledAfterItsShard(FileSystemWriter):
        """Test-only (:data:`KILL_IN_WRITE_ENV`): writes this rank's shard, then SIGKILLs
        itself -- before the results reach rank 0, so no ``.metadata`` is ever written."""

        def write_data(self, plan: Any, planner: Any) -> Any:
            import signal

            written = super().write_data(plan, planner)
            written.wait()
            os.kill(os.getpid(), signal.SIGKILL)
            return written

    return KilledAfterItsShard(tmp, sync_files=True)
