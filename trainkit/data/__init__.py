"""Feeding the device in three stages: source -> loader -> device.

* ``sources/`` -- one module per kind of data (tensors, image_folder, dataset, webdataset,
  tokens, hf_text), registered in :data:`SOURCES` by ``data.name``; :func:`load_data` builds
  a run's loaders and reads its class count.
* ``loader/`` -- :class:`ResumableLoader`, the one owner of the position (epoch, batch): the
  DataLoader variant (:func:`make_loader`: workers, pinning, a rank's shard, per-batch seeds)
  and the in-memory one (:class:`InMemoryLoader`); all resume mid-epoch exactly
  (:class:`ResumableData`).
* ``device/`` -- :class:`DevicePrefetcher`: the copy ahead of use, GPU decoding, the bad-file
  check and normalisation on the device.

``python -m trainkit.data`` runs the offline tools (``tools/``: download, verify, tokenize,
shards). The commands after training (``trainkit.entry``) read a split, its class names and
image files through the names exported here, not the modules inside.
"""

from trainkit.core.rng import mix_seed
from trainkit.data.classes import read_classes, write_classes
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
from trainkit.data.sources import SOURCES, Data, build_loaders, load_data
from trainkit.data.sources.dataset import Samples
from trainkit.data.sources.image_folder import read_image_folder
from trainkit.data.sources.tensors import READERS, TensorData
from trainkit.data.sources.tokens import TokenLoader
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
    "SOURCES",
    "Data",
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
    "load_data",
    "load_image",
    "make_loader",
    "mix_seed",
    "read_classes",
    "read_image_folder",
    "stats_for",
    "transform_for",
    "write_classes",
]
