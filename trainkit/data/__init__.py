"""Feeding the device: in-memory loaders, a DataLoader factory, a device prefetcher.

Two paths, one interface -- :class:`ResumableData`: ``len``, iteration,
``set_epoch(epoch, start_batch)``, ``state_dict``, ``load_state_dict``:

* :class:`InMemoryLoader` -- the whole split as one uint8 tensor (on the GPU when training
  there), batches by index gather, augmentation on the batch on the device. The fast path.
* :func:`make_loader` -> :class:`ResumableLoader` -- torch's DataLoader over any map-style
  dataset with sensible workers, pinning, seeding and resumable sharded order; wrap it in
  :class:`DevicePrefetcher` to overlap copies with compute. The standard path, done right.
* :class:`TokenLoader` -- windows of a memory-mapped token corpus (``data=tokens``); image
  shards stream through :mod:`trainkit.data.shards` (``data=webdataset``).

``python -m trainkit.data download|verify`` fetches and checks the files for offline clusters;
``tokenize`` and ``shards`` write token corpora and image shards.
"""

from trainkit.core.rng import mix_seed
from trainkit.data.build import build_loaders
from trainkit.data.device.prefetch import DevicePrefetcher
from trainkit.data.loader.augment import crop_flip
from trainkit.data.loader.memory import InMemoryLoader
from trainkit.data.loader.order import epoch_order
from trainkit.data.loader.resumable import (
    ResumableBatchSampler,
    ResumableData,
    ResumableLoader,
    default_num_workers,
    make_loader,
)
from trainkit.data.tokens import TokenLoader

__all__ = [
    "DevicePrefetcher",
    "InMemoryLoader",
    "ResumableBatchSampler",
    "ResumableData",
    "ResumableLoader",
    "TokenLoader",
    "build_loaders",
    "crop_flip",
    "default_num_workers",
    "epoch_order",
    "make_loader",
    "mix_seed",
]
