"""Feeding the device in three stages: source -> loader -> device.

* ``sources/`` -- one :class:`Source` per kind of data, in :data:`SOURCES` by ``data.name``
  (:func:`source_of`); ``pipeline.py``'s :func:`load_data` builds a run's loaders from it.
* ``batches.py`` -- the types a batch takes on its way, imported by every stage.
* ``loader/`` -- :class:`ResumableLoader` (epoch, batch): the DataLoader variant
  (:func:`make_loader`) and the in-memory one (:class:`InMemoryLoader`); all resume mid-epoch
  exactly (:class:`ResumableData`).
* ``device/`` -- :class:`DevicePrefetcher`: the copy ahead of use, GPU decoding, the bad-file
  check and normalisation on the device.

``python -m trainkit.data`` runs the offline tools (``tools/``). The commands ask a kind of
data through the names exported here (:func:`source_of`), not the modules inside.
"""

from trainkit.core.rng import mix_seed
from trainkit.data.batches import BadFile, ImageBatch
from trainkit.data.classes import read_classes, write_classes
from trainkit.data.device.prefetch import DevicePrefetcher
from trainkit.data.loader.augment import crop_flip
from trainkit.data.loader.memory import InMemoryLoader
from trainkit.data.loader.resumable import (
    ResumableBatchSampler,
    ResumableData,
    ResumableLoader,
    default_num_workers,
    epoch_order,
    make_loader,
)
from trainkit.data.loader.tokens import TokenLoader
from trainkit.data.pipeline import Data, build_loaders, load_data
from trainkit.data.sources import SOURCES, source_of
from trainkit.data.sources.dataset import Samples
from trainkit.data.sources.image_folder import read_image_folder
from trainkit.data.sources.source import Source
from trainkit.data.sources.tensors import READERS, TensorData
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
    "BadFile",
    "Data",
    "DevicePrefetcher",
    "ImageBatch",
    "InMemoryLoader",
    "ResumableBatchSampler",
    "ResumableData",
    "ResumableLoader",
    "Samples",
    "Source",
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
    "source_of",
    "stats_for",
    "transform_for",
    "write_classes",
]
