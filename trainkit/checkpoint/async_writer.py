"""Checkpoints written on a background thread: the loop waits only for a copy of the state.

A save copies every tensor to CPU memory of its own (the loop may change the weights the moment
it goes on), then a thread writes the copy with the same atomic steps as a synchronous save
(:class:`~trainkit.checkpoint.files.CheckpointFiles` or
:class:`~trainkit.checkpoint.remote.RemoteCheckpoints`), one write in flight at a time. Its
:class:`Background` thread is the one background writer: the sharded saves (DCP's, local or to
a store, with their uploads) run on it too. A failed write is raised by the next
:meth:`~AsyncCheckpointWriter.save` or :meth:`~AsyncCheckpointWriter.wait` and leaves every
earlier checkpoint as it was. The price: host memory for one more copy.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from trainkit.core.errors import one_line
from trainkit.core.tree import tree_leaves, tree_map

log = logging.getLogger("trainkit")


def snapshot(state: Any, reuse: Any = None) -> Any:
    """A copy of ``state`` whose tensors are CPU tensors of their own (dicts, lists, tuples copied).

    ``reuse``: an earlier snapshot no longer needed; its tensors that match in shape, dtype and
    strides are written into instead of allocated (no new memory per save; for CUDA tensors
    the pinned memory is allocated once). CUDA tensors are copied without waiting for each
    one, then each GPU that held some is waited for once.
    """
    from_cuda: set[torch.device] = set()
    olds = {path: t for path, t in tree_leaves(reuse) if isinstance(t, torch.Tensor)}

    def copy(tensor: torch.Tensor, path: str) -> torch.Tensor:
        tensor, old = tensor.detach(), olds.get(path)
        fits = (old is not None and old.shape == tensor.shape and old.dtype == tensor.dtype
                and old.stride() == tensor.stride())
        out = old if fits else torch.empty_like(tensor, device="cpu", pin_memory=tensor.is_cuda)
        if tensor.is_cuda:
            from_cuda.add(tensor.device)
        return out.copy_(tensor, non_blocking=tensor.is_cuda)

    copied = tree_map(copy, state, with_path=True, share=False)
    wait_for_copies(from_cuda)
    return copied


def wait_for_copies(devices: set[torch.device]) -> None:
    """Block until the copies queued on each of ``devices`` so far have landed.

    An event recorded on each source GPU's current stream (where its device-to-host copies run)
    covers them. Not ``torch.cuda.synchronize()``: without a device it waits for the current one
    (cuda:0 unless set, so a run on cuda:1 would hand over a half-copied snapshot), and it would
    wait for other streams' work too (the prefetcher's next batch).
    """
    for device in devices:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()


class Writer(Protocol):
    """What the background thread writes through: a synchronous ``save``."""

    def save(self, state: dict[str, Any], step: int, *, periodic: bool = True,
             best: bool = False) -> Any: ...


class AsyncCheckpointWriter:
    """Saves through ``manager`` on a background thread; same arguments as its ``save``.

    Example:
        >>> manager = CheckpointFiles("runs/a/checkpoints")  # doctest: +SKIP
        >>> writer = AsyncCheckpointWriter(manager)
        >>> writer.save(state, step=100)   # returns once the state is copied
        >>> writer.wait()                  # the file is on disk (or the write's error is raised)
    """

    def __init__(self, manager: Writer) -> None:
        self.manager = manager
        self._background = Background()
        self._staging: Any = None  # the last snapshot: its memory is reused by the next one

    def save(self, state: dict[str, Any], step: int, *, periodic: bool = True,
             best: bool = False) -> None:
        """Copy ``state`` and start writing it; waits for the previous write first.

        Raises:
            TrainkitError: the previous write failed (disk full, read-only folder).
        """
        self.wait()  # also frees the staging memory for reuse: its file is written
        copied = self._staging = snapshot(state, reuse=self._staging)
        self._background.start(lambda: self.manager.save(copied, step, periodic=periodic,
                                                         best=best), step)

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk; raise its error if it failed."""
        self._background.wait()

    def close(self) -> None:
        """Like :meth:`wait`, but a failed write is logged, not raised (the exit already fails)."""
        self._background.close()


class Background:
    """One checkpoint write at a time on a thread of its own; its error, kept, is raised by the
    next :meth:`wait` on the training thread."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, work: Callable[[], None], step: int) -> None:
        """Run ``work`` in the background (the previous work must have been waited for)."""
        # Not a daemon: an interpreter that is exiting still finishes the file it is writing.
        self._thread = threading.Thread(target=self._run, args=(work,),
                                        name=f"trainkit-checkpoint-{step}")
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as err:  # handed to the training thread by wait()
            self._error = err

    @property
    def done(self) -> bool:
        """Whether no work is running (ended or none started): :meth:`wait` would not block."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        """Block until the work in flight (if any) is done; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Like :meth:`wait`, but an error is logged, not raised (the exit already fails)."""
        try:
            self.wait()
        except Exception as err:  # the error already being raised matters more
            log.error("the last checkpoint write failed too: %s", one_line(err))
