"""The shard loader: ``data=webdataset``'s stream of tar shards read by persistent workers.

The stream (the source's ``IterableDataset``) makes each rank's batches of one pass; this
loader tells it the pass (``epoch``, ``start``) before each and serves the resume protocol of
every trainkit loader.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from trainkit.core.signals import shielded_worker_init
from trainkit.data.loader.resumable import ResumableLoader


class ShardLoader(ResumableLoader):
    """One rank's batches of shards (``ShardBatch``); every trainkit loader's resume protocol."""

    def __init__(self, stream: Any, *, num_workers: int, batches: int | None) -> None:
        self.stream, self.num_workers, self._batches = stream, num_workers, batches
        self.batch_size = stream.batch_size
        # persistent workers: started once, each pass's epoch and start read from shared memory
        self.loader = DataLoader(stream, batch_size=None, num_workers=num_workers,
                                 persistent_workers=num_workers > 0,
                                 worker_init_fn=shielded_worker_init(None) if num_workers
                                 else None)

    def __len__(self) -> int:
        if self._batches is None:
            raise TypeError("the batch count of these shards is unknown (no shards.json)")
        return self._batches

    def _pass(self, epoch: int, start: int) -> Iterator[Any]:
        self.stream.start, self.stream.epoch = start, epoch
        return iter(self.loader)
