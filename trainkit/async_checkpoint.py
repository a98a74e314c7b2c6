"""Checkpoints written on a background thread: the loop waits only for a copy of the state.

A save first copies every tensor of the state to fresh CPU memory (the snapshot: the loop may
change the weights the moment it goes on), then a thread writes the copy through
:class:`~trainkit.checkpoint.CheckpointManager`, with the same atomic, fsynced steps as a
synchronous save. One write is in flight at a time: the next save waits for the previous one.
A failed write is reported by the next :meth:`AsyncCheckpointWriter.save` or
:meth:`~AsyncCheckpointWriter.wait`, and, like a failed synchronous save, leaves every earlier
checkpoint as it was.

The price is host memory for one more copy of the state while a write is in flight.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from trainkit.checkpoint import CheckpointManager
from trainkit.errors import one_line

log = logging.getLogger("trainkit")


def snapshot(state: Any) -> Any:
    """A copy of ``state`` whose tensors are fresh CPU tensors (dicts, lists and tuples copied).

    CUDA tensors are copied without waiting for each one, then the device is synchronised once.
    """
    on_cuda: list[bool] = []

    def copy(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "cpu":
                return obj.detach().clone()
            on_cuda.append(obj.device.type == "cuda")
            return obj.detach().to("cpu", non_blocking=True)
        if isinstance(obj, dict):
            return type(obj)((k, copy(v)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)):
            items = [copy(v) for v in obj]
            return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        return obj

    copied = copy(state)
    if any(on_cuda):
        torch.cuda.synchronize()  # the non_blocking copies must land before the thread reads them
    return copied


class AsyncCheckpointWriter:
    """Saves through ``manager`` on a background thread; same arguments as its ``save``.

    Example:
        >>> manager = CheckpointManager("runs/a/checkpoints")  # doctest: +SKIP
        >>> writer = AsyncCheckpointWriter(manager)
        >>> writer.save(state, step=100)   # returns once the state is copied
        >>> writer.wait()                  # the file is on disk (or the write's error is raised)
    """

    def __init__(self, manager: CheckpointManager) -> None:
        self.manager = manager
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, state: dict[str, Any], step: int, *, periodic: bool = True,
             best: bool = False) -> None:
        """Copy ``state`` and start writing it; waits for the previous write first.

        Raises:
            TrainkitError: the previous write failed (disk full, read-only folder).
        """
        self.wait()
        copied = snapshot(state)
        # Not a daemon: an interpreter that is exiting still finishes the file it is writing.
        self._thread = threading.Thread(target=self._write, args=(copied, step, periodic, best),
                                        name=f"trainkit-checkpoint-{step}")
        self._thread.start()

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Like :meth:`wait`, but a failed write is logged, not raised (the exit already fails)."""
        try:
            self.wait()
        except Exception as err:  # the error already being raised matters more
            log.error("the last checkpoint write failed too: %s", one_line(err))

    def _write(self, state: dict[str, Any], step: int, periodic: bool, best: bool) -> None:
        try:
            self.manager.save(state, step, periodic=periodic, best=best)
        except BaseException as err:  # handed to the training thread by wait()
            self._error = err
