"""Where and how checkpoints are kept: one interface, a storage per format.

The :class:`~trainkit.checkpoint.checkpointer.Checkpointer` decides what a checkpoint holds and
when; a :class:`Storage` decides how and where (names, atomic writes, rotation, finding and
loading one to resume from). :class:`FileStorage` keeps one file per checkpoint written by
rank 0 (:mod:`~trainkit.checkpoint.files`, :mod:`~trainkit.checkpoint.async_writer`);
:class:`ShardedStorage` one directory per checkpoint written by every rank through DCP
(:mod:`~trainkit.checkpoint.sharded`). Where they are -- a disk or an object store -- is the
location's business (:mod:`~trainkit.checkpoint.location`), handed in, never tested here.
:func:`storages_for` chooses once: the storage this run writes with first, then the others,
which only read (``init_from`` of a file into a sharded run, say).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from trainkit.checkpoint import location, remote_sharded, reshard, sharded
from trainkit.checkpoint.async_writer import AsyncCheckpointWriter
from trainkit.checkpoint.contents import check_weights_fit
from trainkit.checkpoint.files import CheckpointFiles
from trainkit.checkpoint.location import Folder
from trainkit.checkpoint.remote import RemoteCheckpoints
from trainkit.config import CheckpointConfig
from trainkit.core import rng
from trainkit.core.errors import TrainkitError
from trainkit.core.runtime import Runtime
from trainkit.distributed import fsdp

log = logging.getLogger("trainkit")


@dataclass(frozen=True)
class Content:
    """What the Checkpointer hands a storage to write: the registered parts (``model``,
    ``optimizer``, ``ema``, ``data``, ...), ``state_dict(exclude=...)`` (every part's state and
    the run's, but the parts excluded: a storage that writes some parts its own way excludes
    them), and every rank's RNG state on rank 0 (None elsewhere)."""

    parts: Mapping[str, Any]
    state_dict: Callable[..., dict[str, Any]]
    rng_per_rank: list[Any] | None


class Storage(Protocol):
    """How and where checkpoints of one format are kept: the verbs another storage (an object
    store, say) implements. The names and the rotation are :class:`~trainkit.checkpoint.layout.
    Layout`'s. Every rank makes one at the same point and calls :meth:`save` together."""

    @property
    def last(self) -> Path | str:
        """The name of the newest complete checkpoint (for messages; a URL's is a string)."""

    @property
    def best(self) -> Path | str:
        """The name of the best checkpoint by ``checkpoint.monitor`` (summary.json's ``best``;
        a URL's is a string)."""

    @property
    def in_flight(self) -> bool:
        """Whether a save is still being written and waits for :meth:`poll` to publish it."""

    def save(self, step: int, content: Content, *, periodic: bool,
             best: bool) -> Path | str | None:
        """Write step ``step`` (also as the numbered one when ``periodic``, and as the best when
        ``best``), then rotate; earlier checkpoints are intact when it fails. Returns where it
        is (or is being written, when async) on every rank; None when this run writes none."""

    def list(self) -> list[Path | str]:
        """This run's checkpoints that ``checkpoint.resume=auto`` may continue from, newest
        first (none where this run's model cannot take their optimizer state)."""

    def holds(self, checkpoint: Path | str | Mapping[str, Any]) -> bool:
        """Whether ``checkpoint`` is of this format: a path or URL (``checkpoint.resume``,
        ``checkpoint.init_from``) or a state that :meth:`read` returned."""

    def read(self, path: Path | str, key: str) -> dict[str, Any]:
        """The checkpoint at ``path``, its ``_path`` set (``key`` names the setting, for the
        messages)."""

    def load(self, state: Mapping[str, Any], parts: Mapping[str, Any], *, key: str,
             optimizer: bool) -> bool:
        """The model's weights (and the optimizer's state when ``optimizer``) and the EMA's
        into ``parts``; returns whether EMA weights were loaded."""

    def carry_over(self, state: Mapping[str, Any], counters: Any, data: Any) -> str:
        """Restore this rank's RNG and fix the loop's data position (``counters``) for this
        run's ranks; words for the resume's log line."""

    def poll(self) -> None:
        """Publish a save that has ended (cheap when none has)."""

    def wait(self) -> None:
        """Block until the last save is on disk; raise its write's error."""

    def close(self) -> None:
        """Let a write still in flight end whole; its error is logged, not raised."""


def storages_for(model: nn.Module, where: Folder | None, config: CheckpointConfig,
                 runtime: Runtime) -> tuple[Storage, ...]:
    """This run's storages in ``where`` (None: it writes none), the one it writes with first:
    directories for a model sharded by ``fully_shard`` (FSDP2), else files. A collective: every
    rank calls it at the same point."""
    if fsdp.is_sharded(model):  # a sharded optimizer takes its state from directories only
        return (ShardedStorage(where, config, runtime, writes=True),
                FileStorage(where, config, runtime, writes=False, listed=False))
    return (FileStorage(where, config, runtime, writes=True),
            ShardedStorage(where, config, runtime, writes=False))


class FileStorage:
    """``step_<N>.pt``, ``last.pt`` and ``best.pt`` in ``where``: rank 0 writes whole files
    atomically (on a thread of their own with ``checkpoint.async_save``), every rank reads. In a
    store they are objects and commit records (:mod:`~trainkit.checkpoint.remote`).

    ``where`` None: the run writes no checkpoints (it can still start from a named one).
    ``listed`` False: :meth:`list` finds none (a sharded run resumes from directories only).
    """

    def __init__(self, where: Folder | None, config: CheckpointConfig,
                 runtime: Runtime, *, writes: bool = True, listed: bool = True) -> None:
        self.runtime, self.listed = runtime, listed
        self.manager: CheckpointFiles | RemoteCheckpoints | None = (
            where.files(config.keep_last) if where is not None else None)
        self.writes = writes and self.manager is not None and runtime.is_main  # rank 0 writes
        self._writer = (AsyncCheckpointWriter(self.manager)
                        if self.writes and config.async_save else None)

    @property
    def last(self) -> Path | str:
        return self.manager.last if self.manager is not None else Path("last.pt")

    @property
    def best(self) -> Path | str:
        return self.manager.best if self.manager is not None else Path("best.pt")

    in_flight = False  # a background write blocks only the next save: nothing to publish

    def save(self, step: int, content: Content, *, periodic: bool,
             best: bool) -> Path | str | None:
        if self.manager is None:
            return None
        if self.writes:
            state = content.state_dict()
            if self.runtime.distributed:
                state["rng_per_rank"] = content.rng_per_rank
            # async: returns once the state is copied
            (self._writer or self.manager).save(state, step, periodic=periodic, best=best)
        return self.manager.step_path(step) if periodic else self.manager.last

    def list(self) -> list[Path | str]:
        return self.manager.candidates() if self.manager is not None and self.listed else []

    def holds(self, checkpoint: Path | str | Mapping[str, Any]) -> bool:
        if isinstance(checkpoint, (Path, str)):  # a missing path too: its message says so
            return not location.is_sharded_checkpoint(checkpoint)
        return "format" not in checkpoint

    def read(self, path: Path | str, key: str) -> dict[str, Any]:
        return location.read_file(path, key)

    def load(self, state: Mapping[str, Any], parts: Mapping[str, Any], *, key: str,
             optimizer: bool) -> bool:
        model, ema = parts["model"], parts["ema"]
        if optimizer and fsdp.is_sharded(model):
            raise TrainkitError(
                f"{state.get('_path', 'the checkpoint')} is a single-file checkpoint: a sharded "
                "(fsdp) run resumes from a checkpoint directory; start from its weights with "
                "checkpoint.init_from and checkpoint.resume=null")
        # torch would list the same differences, as a traceback
        check_weights_fit(model.state_dict(), state["model"], key=key,
                          path=state.get("_path", "?"))
        if fsdp.is_sharded(model):  # each rank keeps its shard of the full weights
            reshard.load_full_weights(model, state["model"])
            return False  # a sharded EMA restarts from the loaded weights
        model.load_state_dict(state["model"])
        if optimizer:
            parts["optimizer"].load_state_dict(state["optimizer"])
        if ema is None or state.get("ema") is None:
            return False
        ema.load_state_dict(state["ema"])
        return True

    def carry_over(self, state: Mapping[str, Any], counters: Any, data: Any) -> str:
        rng.set_rng_state(rng.rng_of_rank(state, self.runtime.rank))
        return ""

    def poll(self) -> None:
        pass

    def wait(self) -> None:
        if self._writer is not None:
            self._writer.wait()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class ShardedStorage:
    """``step_<N>/`` directories with ``last`` and ``best`` links in ``where``: every rank
    writes its shards through DCP, rank 0 adds ``trainkit.pt`` (the rest of the state); they load
    into a sharded or a plain model on any number of ranks. In a store they are object folders
    and commit records (:mod:`~trainkit.checkpoint.remote_sharded`).

    ``writes``: this run saves here (with the process group DCP's collectives run on); a storage
    that only reads loads on the default group.
    """

    def __init__(self, where: Folder | None, config: CheckpointConfig,
                 runtime: Runtime, *, writes: bool = True) -> None:
        self.where, self.runtime = where, runtime
        # a collective with async_save (a gloo group of its own): made by every rank at once
        self._dirs: sharded.ShardedCheckpoints | remote_sharded.RemoteShardedCheckpoints | None
        self._dirs = (where.shards(config.keep_last, async_save=config.async_save)
                      if writes and where is not None else None)

    @property
    def last(self) -> Path | str:
        return self._dirs.last if self._dirs is not None else Path("last")

    @property
    def best(self) -> Path:
        return self._dirs.best if self._dirs is not None else Path("best")

    @property
    def in_flight(self) -> bool:
        return self._dirs is not None and self._dirs.in_flight

    def save(self, step: int, content: Content, *, periodic: bool,
             best: bool) -> Path | str | None:
        """Every rank writes its part of ``step_<step>/``; rank 0 adds ``trainkit.pt``."""
        if self._dirs is None:
            return None
        parts, meta = content.parts, None
        if self.runtime.is_main:
            ema = parts["ema"]
            meta = {**content.state_dict(exclude=("model", "optimizer", "ema")),
                    "format": sharded.FORMAT, "world_size": self.runtime.world_size,
                    "rng_per_rank": content.rng_per_rank,
                    "batch_size": getattr(parts["data"], "batch_size", None),
                    "ema": {"decay": ema.decay, "updates": ema.updates} if ema else None}
        if self._dirs.written_step == step:  # the same step again (now the best): same
            self._dirs.update_meta(meta, step, best=best)  # weights, only trainkit.pt changed
        else:
            tensors = reshard.tensor_state(parts["model"], parts["optimizer"], parts["ema"])
            self._dirs.save(tensors, meta, step, best=best)
        return self._dirs.step_path(step)

    def list(self) -> list[Path | str]:
        if self._dirs is not None:
            return self._dirs.candidates()
        # DCP reshards onto any model, sharded or not: a plain run lists them too
        return self.where.sharded_candidates() if self.where is not None else []

    def holds(self, checkpoint: Path | str | Mapping[str, Any]) -> bool:
        if isinstance(checkpoint, (Path, str)):
            return location.is_sharded_checkpoint(checkpoint)
        return checkpoint.get("format") == sharded.FORMAT

    def read(self, path: Path | str, key: str) -> dict[str, Any]:
        # a record's checkpoint is downloaded into a local folder, removed once loaded
        return location.read_shards(path, key)

    def load(self, state: Mapping[str, Any], parts: Mapping[str, Any], *, key: str,
             optimizer: bool) -> bool:
        """Model, optimizer and EMA weights from a directory, resharded onto this run."""
        model, ema = parts["model"], parts["ema"]
        try:
            if optimizer:
                group = self._dirs.group if self._dirs is not None else None
                loaded = reshard.load_tensors(state, model, parts["optimizer"], ema, group,
                                              key=key)
            else:
                loaded = reshard.load_weights(state, model, ema)
        finally:
            remote_sharded.forget(state)
        if not (loaded and state.get("ema")):
            return False
        ema.updates = int(state["ema"]["updates"])  # the weights are in place; now the count
        return True

    def carry_over(self, state: Mapping[str, Any], counters: Any, data: Any) -> str:
        return reshard.carry_over(
            state, counters, rank=self.runtime.rank, world_size=self.runtime.world_size,
            batch_size=getattr(data, "batch_size", None),
            batches_per_epoch=len(data) if data is not None else None)

    def poll(self) -> None:
        if self._dirs is not None:
            self._dirs.poll()  # an async save that ended gets its name and `last` now

    def wait(self) -> None:
        if self._dirs is not None:
            self._dirs.wait()

    def close(self) -> None:
        if self._dirs is not None:
            self._dirs.close()
