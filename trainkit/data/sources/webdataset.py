"""``data=webdataset``: image shards (webdataset tars) streamed by every rank and worker.

Shards (``<key>.jpg`` or another image, ``<key>.cls``: the class index) are local paths, URLs
webdataset opens, or fsspec URLs streamed through a bounded local cache
(:mod:`trainkit.data.remote`), given as a brace pattern or a list, or listed in the
``shards.json`` that ``python -m trainkit.data shards`` writes beside them. Images are decoded
and augmented as ``data=image_folder``'s (:mod:`trainkit.data.transforms`).

The order is a function of ``(seed, epoch, rank, batch)`` for a fixed ``num_workers``: rank
``r`` takes every world-size-th shard of the epoch's permutation, each worker every
workers-th of those through a seeded shuffle buffer, and every rank gets the same number of
batches, so a mid-epoch resume hands out exactly the batches an uninterrupted run would (what
a run sees, exactly: docs/data.md, "Image shards").
"""

from __future__ import annotations

import functools
import itertools
import json
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from trainkit.config import WebDatasetConfig
from trainkit.core.errors import ConfigError, TrainkitError, one_line
from trainkit.core.location import child, locate, on_store
from trainkit.core.objectstore import filesystem, join, store_error
from trainkit.core.rng import mix_seed
from trainkit.core.runtime import Runtime
from trainkit.data.remote import is_store_url, open_shard
from trainkit.data.sources.source import Loaded, Options, Shards, Source
from trainkit.data.transforms import IMAGE_SUFFIXES, decode_image, stats_for, transform_for

IMAGE_KEYS = tuple(suffix[1:] for suffix in IMAGE_SUFFIXES)
INDEX = "shards.json"
Transforms = Sequence[Callable[..., Any]] | None


class ShardBatch(NamedTuple):
    """uint8 images ``[B, C, H, W]``, int64 labels, and each sample's ``__key__``."""

    images: torch.Tensor
    labels: torch.Tensor
    keys: list[str]


def _webdataset() -> Any:
    try:
        import webdataset
    except ImportError:
        raise ConfigError("data=webdataset needs the webdataset library: pip install "
                          "'trainkit[shards]'") from None
    return webdataset


class ShardStream(IterableDataset):
    """One rank's batches of one pass, produced by the DataLoader's workers (module docstring).

    The main process sets ``epoch`` and ``start`` before each pass. They live in a shared-memory
    tensor, so persistent workers (started once) read each pass's values when it begins.
    """

    def __init__(self, shards: Sequence[str], *, batch_size: int, batches: int | None,
                 training: bool, transform: Callable[[torch.Tensor], torch.Tensor],
                 channels: int, seed: int, rank: int, world_size: int,
                 shuffle_buffer: int, cache_bytes: int = 0) -> None:
        self.shards, self.batch_size, self.batches = list(shards), batch_size, batches
        self.training, self.transform, self.channels = training, transform, channels
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.shuffle_buffer, self.cache_bytes = shuffle_buffer, cache_bytes
        self._pass = torch.zeros(2, dtype=torch.int64).share_memory_()  # epoch, start batch

    @property
    def epoch(self) -> int:
        return int(self._pass[0])

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._pass[0] = value

    @property
    def start(self) -> int:
        return int(self._pass[1])

    @start.setter
    def start(self, value: int) -> None:
        self._pass[1] = value

    def worker_shards(self, epoch: int, role: int, workers: int, repeat: int = 0) -> list[str]:
        """The shards worker ``role`` reads in ``epoch`` (``repeat``: its n-th time through)."""
        order = list(range(len(self.shards)))
        if self.training:
            generator = torch.Generator().manual_seed(mix_seed(self.seed, epoch))
            order = torch.randperm(len(self.shards), generator=generator).tolist()
        mine = order[self.rank::self.world_size][role::workers]
        if repeat:
            random.Random(mix_seed(self.seed, epoch, self.rank, role, repeat)).shuffle(mine)
        return [self.shards[i] for i in mine]

    def _raw(self, epoch: int, role: int, workers: int) -> Iterator[dict[str, Any]]:
        """The worker's undecoded samples: through its shards once (evaluation), or again and
        again through a seeded shuffle buffer (training)."""
        wds = _webdataset()
        if not self.training:
            return iter(self._samples(self.worker_shards(epoch, role, workers)))
        rounds = (self._samples(self.worker_shards(epoch, role, workers, r))
                  for r in itertools.count())
        rng = random.Random(mix_seed(self.seed, epoch, self.rank, role))
        return wds.shuffle(self.shuffle_buffer, self.shuffle_buffer, rng=rng)(
            itertools.chain.from_iterable(rounds))

    def _samples(self, shards: list[str]) -> Any:
        """The samples of ``shards`` in order: opened by webdataset, or for fsspec URLs
        through the local cache."""
        wds = _webdataset()
        if not any(is_store_url(shard) for shard in shards):
            return wds.DataPipeline(wds.SimpleShardList(shards), wds.tarfile_to_samples())
        tars = wds.tariterators
        return wds.DataPipeline(wds.SimpleShardList(shards),
                                functools.partial(_opened, cache_bytes=self.cache_bytes),
                                tars.tar_file_expander, tars.group_by_keys)

    def __iter__(self) -> Iterator[ShardBatch]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        epoch, start = self.epoch, self.start  # this pass's, read once
        role = (start + worker) % workers  # batches start, start + 1, ... in round robin
        samples = self._raw(epoch, role, workers)
        if not self.training:
            yield from self._batches(samples, itertools.count(), epoch)
            return
        mine = range(role, self.batches, workers)
        done = len([b for b in mine if b < start])  # handed out before a resume
        samples = itertools.islice(samples, done * self.batch_size, None)  # not decoded
        yield from self._batches(samples, mine[done:], epoch)

    def _batches(self, samples: Iterator[dict[str, Any]], numbers: Iterator[int] | range,
                 epoch: int) -> Iterator[ShardBatch]:
        for b in numbers:
            chunk = list(itertools.islice(samples, self.batch_size))
            if not chunk:
                return
            if get_worker_info() is not None:  # augmentation a function of the batch's place
                seed = mix_seed(self.seed, epoch, self.rank, b)
                random.seed(seed)
                np.random.seed(seed % 2**32)
                torch.default_generator.manual_seed(seed)
            yield ShardBatch(torch.stack([self._image(s) for s in chunk]),
                             torch.tensor([_label(s) for s in chunk], dtype=torch.int64),
                             [s["__key__"] for s in chunk])

    def _image(self, sample: Mapping[str, Any]) -> torch.Tensor:
        key = next((k for k in IMAGE_KEYS if k in sample), None)
        if key is None:
            raise TrainkitError(f"sample {sample['__key__']} of {sample.get('__url__')} has no "
                                f"image (its files: {', '.join(sorted(sample))})")
        image = decode_image(sample[key], channels=self.channels, name=sample["__key__"])
        return self.transform(image)


def _label(sample: Mapping[str, Any]) -> int:
    if "cls" not in sample:
        raise TrainkitError(f"sample {sample['__key__']} of {sample.get('__url__')} has no "
                            ".cls file (its class index)")
    return int(sample["cls"])


def _opened(shards: Iterator[dict[str, Any]], cache_bytes: int) -> Iterator[dict[str, Any]]:
    """webdataset's ``url_opener`` for fsspec URLs: each shard as a stream, through the cache."""
    wds = _webdataset()
    for shard in shards:
        url = shard["url"]
        stream = open_shard(url, cache_bytes) if is_store_url(url) else wds.gopen(url)
        yield {**shard, "stream": stream}


def read_index(root: Path | str) -> dict[str, Any]:
    """``shards.json`` of ``root`` (``{}`` when there is none), a folder or a URL."""
    if on_store(root):
        fs, path = filesystem(str(root), "data.root")
        try:
            return json.loads(fs.cat(join(path, INDEX)))
        except FileNotFoundError:
            return {}
        except Exception as err:  # no credentials, no answer: one line that says what to set
            raise (store_error(err, str(root), "data.root") or ConfigError(
                f"cannot read {join(str(root), INDEX)} ({one_line(err, 80)})")) from None
    path = Path(root) / INDEX
    return json.loads(path.read_text()) if path.is_file() else {}


def shard_list(spec: str | Sequence[str] | None, index: Mapping[str, Any], split: str,
               root: Path | str) -> tuple[list[str], int | None]:
    """The shards of ``split`` (a brace pattern, a list, or shards.json's) and, when known from
    shards.json, their samples."""
    if spec is None:
        entries = index.get(split)
        if not entries:
            key = "shards" if split == "train" else "val_shards"
            raise ConfigError(f"no {split} shards: set data.{key} or point data.root at a "
                              f"folder with {INDEX} (python -m trainkit.data shards writes one)")
        names = [child(root, e["shard"]) for e in entries]
        return names, sum(e["samples"] for e in entries)
    wds = _webdataset()
    specs = [spec] if isinstance(spec, str) else list(spec)
    return [url for s in specs for url in wds.shardlists.expand_urls(s)], None


def shard_splits(cfg: WebDatasetConfig, runtime: Runtime, *, seed: int = 0,
                 train_transforms: Transforms = None, eval_transforms: Transforms = None
                 ) -> Loaded:
    """The training and validation shards of ``data=webdataset`` (:class:`Shards`), and the
    class count; ``train_transforms`` / ``eval_transforms`` replace the default transforms
    when given."""
    # Imported here, once: the forked workers have them instead of importing them each (a slow
    # import); and a missing extra is said before anything starts.
    _webdataset()
    import torchvision.io  # decode_image's JPEG path
    import torchvision.transforms.v2.functional  # noqa: F401  (the crops and resizes)
    root = locate(cfg.root)
    index = read_index(root)
    classes = index.get("classes")
    num_classes = cfg.num_classes or (len(classes) if classes else None)
    if not num_classes:
        raise ConfigError(f"no {INDEX} in {root} to tell the classes: set data.num_classes")
    mean, std = stats_for(cfg)
    train = _stream(cfg, runtime, seed, index, train_transforms, training=True)
    val = (_stream(cfg, runtime, seed, index, eval_transforms, training=False)
           if cfg.val_shards is not None or index.get("val") else (None, 0, None))
    # as for an image folder: the class names go to classes.json and into every checkpoint,
    # and a resume on shards of other classes is refused
    described = [Shards(stream, workers, batches, mean=mean, std=std, classes=classes)
                 if stream is not None else None for stream, workers, batches in (train, val)]
    return described[0], described[1], int(num_classes)


def _stream(cfg: WebDatasetConfig, runtime: Runtime, seed: int, index: Mapping[str, Any],
            custom: Transforms, *, training: bool) -> tuple[ShardStream, int, int | None]:
    """One split's stream, its worker count and its batches per pass (None: unknown)."""
    shards, samples = shard_list(cfg.shards if training else cfg.val_shards, index,
                                 "train" if training else "val",
                                 locate(cfg.root))
    workers = cfg.num_workers if cfg.num_workers is not None else 2
    world = runtime.world_size
    if not training:  # each rank reads its shards once, a worker each at most (none: nothing)
        workers = min(workers, len(shards[runtime.rank::world]))
    elif len(shards) < world * max(workers, 1):
        raise ConfigError(f"{len(shards)} training shards for {world} rank(s) x "
                          f"{max(workers, 1)} worker(s): each needs one; write smaller shards "
                          "or lower data.num_workers")
    batch_size = cfg.batch_size if training else cfg.eval_batch_size
    if training:
        per_rank = cfg.epoch_samples or (samples // world if samples else None)
        if not per_rank:
            raise ConfigError("data.epoch_samples is needed with shards of your own (no "
                              f"{INDEX}): the training samples per rank in an epoch")
        batches = per_rank // batch_size
        if batches == 0:
            raise ConfigError(f"data.batch_size={batch_size} is larger than an epoch's "
                              f"{per_rank} samples per rank")
    else:
        batches = None if cfg.val_shards is not None else _eval_batches(
            index["val"], runtime, workers, batch_size)
    stream = ShardStream(shards, batch_size=batch_size, batches=batches, training=training,
                         transform=transform_for(cfg, training=training, custom=custom),
                         channels=cfg.channels, seed=seed, rank=runtime.rank,
                         world_size=world, shuffle_buffer=cfg.shuffle_buffer,
                         cache_bytes=int(cfg.cache_gb * 2**30))
    return stream, workers, batches


def _eval_batches(entries: Sequence[Mapping[str, Any]], runtime: Runtime, workers: int,
                  batch_size: int) -> int:
    """This rank's validation batches: each worker's samples in batches, the last one short."""
    mine = list(entries)[runtime.rank::runtime.world_size]
    return sum(-(-sum(e["samples"] for e in mine[w::max(workers, 1)]) // batch_size)
               for w in range(max(workers, 1)))


def load(cfg: WebDatasetConfig, runtime: Runtime, options: Options) -> Loaded:
    """:func:`shard_splits` as :data:`trainkit.data.sources.SOURCES` calls it."""
    return shard_splits(cfg, runtime, seed=options.seed,
                        train_transforms=options.train_transforms,
                        eval_transforms=options.eval_transforms)


SOURCE = Source("webdataset", WebDatasetConfig, load, reader_replaces=False)
