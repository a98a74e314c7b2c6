"""The resume protocol every trainkit loader implements, and what the Trainer asks of any loader.

A resumable loader can be pointed at any batch of any epoch without loading the batches before
it (``set_epoch(epoch, start_batch)``), and reports where it is (``state_dict``). The Trainer
keeps the position in its own state (epoch, batches of it trained on) and points the loader there
at the start of every epoch; the loader's ``state_dict`` is saved with each checkpoint, and
``load_state_dict`` lets a script that drives a loader by hand resume it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from trainkit.core.errors import TrainkitError


@runtime_checkable
class ResumableData(Protocol):
    """What :class:`~trainkit.data.InMemoryLoader`, :class:`~trainkit.data.ResumableLoader` and
    :class:`~trainkit.data.DevicePrefetcher` share; implement it to make your own loader resume
    exactly mid-epoch. ``len()`` is always the whole epoch's batch count."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Any]: ...

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """The next pass serves ``epoch`` from batch ``start_batch`` on."""

    def state_dict(self) -> dict[str, Any]:
        """At least ``{"epoch": e, "batch": b}``: b batches of epoch e were handed out."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s position with the next pass."""


@dataclass
class DataPosition:
    """Where a loader is, kept the same way by every trainkit loader."""

    epoch: int = 0
    batch: int = 0  # batches of `epoch` handed out
    start: int = 0  # where the next pass begins (a resume offset applies to one pass only)

    def set(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.batch, self.start = epoch, start_batch, start_batch

    def begin_pass(self) -> int:
        """The batch this pass starts at; later passes start at 0."""
        start, self.start = self.start, 0
        self.batch = start
        return start

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}


def saved_position(state: Mapping[str, Any]) -> tuple[int, int]:
    """``(epoch, batch)`` from a loader's :meth:`~ResumableData.state_dict`."""
    return int(state["epoch"]), int(state["batch"])


class PositionedLoader:
    """The resume protocol of a loader whose place is one :class:`DataPosition`,
    ``self.position``; one that must also point a sampler or a wrapped loader extends
    :meth:`set_epoch`."""

    position: DataPosition

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Serve ``epoch`` from batch ``start_batch`` on; the batches before are never loaded."""
        self.position.set(epoch, start_batch)

    def state_dict(self) -> dict[str, Any]:
        """The epoch and the batches of it already handed out (one in flight is not counted)."""
        return self.position.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s position with the next pass."""
        self.set_epoch(*saved_position(state))


def set_epoch(data: Any, epoch: int, start_batch: int) -> None:
    """Point any loader at an epoch and, when resuming, a batch inside it.

    A :class:`ResumableData` skips the batches before ``start_batch`` without loading them; any
    other loader with a ``set_epoch(epoch)`` (``DistributedSampler``'s, on the loader or its
    sampler) gets the epoch, and ``start_batch > 0`` is an error for it.
    """
    if isinstance(data, ResumableData):
        data.set_epoch(epoch, start_batch)
        return
    # Not resumable: a set_epoch(epoch) of another kind (DistributedSampler's) gets the epoch.
    inner = getattr(data, "set_epoch", None) or getattr(getattr(data, "sampler", None),
                                                        "set_epoch", None)
    if inner is not None:
        inner(epoch)
    if start_batch:
        raise TrainkitError(
            f"cannot resume inside an epoch with a {type(data).__name__}: it cannot start at "
            f"batch {start_batch}; use trainkit's loaders or checkpoint at epoch ends"
        )


class MappedBatches:
    """A resumable loader's batches passed through ``fn`` (``(images, labels)`` out of a loader's
    own batch type, a check on the way); the resume protocol and the length are the loader's."""

    def __init__(self, loader: Any, fn: Callable[[Any], Any]) -> None:
        self.loader, self.fn = loader, fn
        self.batch_size = loader.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.loader.set_epoch(epoch, start_batch)

    def state_dict(self) -> dict[str, int]:
        return self.loader.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def __iter__(self) -> Iterator[Any]:
        batches: Iterable[Any] = self.loader
        return map(self.fn, batches)
