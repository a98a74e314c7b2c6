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
``tokenize`` and ``shards`` write token corpora and image shards. The commands after training
(``trainkit.entry``) read a split, its class names and image files through the names exported
here (``READERS``, ``TensorData``, ``Samples``, ``load_image``, ...), not the modules inside.
"""

from trainkit.core.rng import mix_seed
from trainkit.data.augment import crop_flip
from trainkit.data.build import READERS, build_loaders
from trainkit.data.classes import read_classes, write_classes
from trainkit.data.datasets import TensorData
from trainkit.data.image_folder import read_image_folder
from trainkit.data.loaders import (
    ResumableBatchSampler,
    ResumableLoader,
    default_num_workers,
    make_loader,
)
from trainkit.data.memory import InMemoryLoader
from trainkit.data.order import epoch_order
from trainkit.data.own_data import Samples
from trainkit.data.prefetch import DevicePrefetcher
from trainkit.data.resumable import ResumableData
from trainkit.data.tokens import TokenLoader
from trainkit.data.transforms import (
    IMAGE_SUFFIXES,
    UnreadableImage,
    load_image,
    stats_for,
    transform_for,
)

__all__ = [
    "IMAGE_SUFFIXES",
    "READERS",
    "DevicePrefetcher",
    "InMemoryLoader",
    "ResumableBatchSampler",
    "ResumableData",
    "ResumableLoader",
    "Samples",
    "TensorData",
    "TokenLoader",
    "UnreadableImage",
    "build_loaders",
    "crop_flip",
    "default_num_workers",
    "epoch_order",
    "load_image",
    "make_loader",
    "mix_seed",
    "read_classes",
    "read_image_folder",
    "stats_for",
    "transform_for",
    "write_classes",
]
