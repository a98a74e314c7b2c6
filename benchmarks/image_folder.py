"""Images/s of ``data=image_folder``'s training loader against the loader users write by hand.

    python -m benchmarks.image_folder              # 3000 photo-like JPEGs, 2 workers
    python -m benchmarks.image_folder --quick      # a few batches: checks it works, not speed

The files (:mod:`benchmarks.photos`): cut, scaled and jittered from real photographs, 350-500 px
on the short side, JPEG quality 88-92. Three sides, measured alternately in one run
(:func:`benchmarks.common.alternate`, palindromic rounds), each yielding the same thing --
shuffled batches of 224x224 random-resized crops (torchvision's crop distribution), flipped,
normalised float32:

* hand: ``torchvision.datasets.ImageFolder`` + ``v2.RandomResizedCrop(224)``,
  ``RandomHorizontalFlip``, ``ToImage``, ``ToDtype(float32, scale=True)``, ``Normalize``, in a
  ``DataLoader(shuffle=True, pin_memory=<CUDA>, persistent_workers=True)``;
* trainkit: the loader ``data=image_folder`` trains from (libjpeg-turbo on the file bytes, crop
  and resize on uint8 tensors, uint8 batches, normalisation in one pass where the batch lands);
* ceiling: one process doing the same work with no loader -- reading, decoding and cropping the
  files with trainkit's transform, stacking batches, and on a CPU normalising them (on a GPU the
  GPU does that): the per-core rate no loader of that work can beat;
* trainkit+aug / hand+aug: both loaders with torchvision's ``RandAugment`` and
  ``RandomErasing(p=0.25)`` after the crop and flip (``data.auto_augment=randaugment
  data.random_erasing=0.25``; by hand in the v2 list, erasing after normalising): what the
  regularisation costs the loader;
* webdataset: ``data=webdataset``'s loader on the same files written as shards (``python -m
  trainkit.data shards``; the same transforms), reported beside trainkit's (no goal: streaming
  tars trades the random access of files for sequential reads a network store serves well).

Same worker count and batch size for both loaders; a rate counts the batches after the ones
ready when the clock starts (workers fill their prefetch queue while the other side runs).
Goals: trainkit >= 1.5x hand, and >= 0.85x workers x ceiling.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import alternate, emit, median, ratio, row
from benchmarks.photos import photo_folder


class Stream:
    """Batches from a loader, epoch after epoch, from one live iterator."""

    def __init__(self, loader: Any) -> None:
        self.loader, self.iterator, self.epoch = loader, None, 0

    def next(self) -> Any:
        while True:
            if self.iterator is None:
                if hasattr(self.loader, "set_epoch"):
                    self.loader.set_epoch(self.epoch)
                self.iterator, self.epoch = iter(self.loader), self.epoch + 1
            try:
                return next(self.iterator)
            except StopIteration:
                self.iterator = None

    def rate(self, batches: int, ready: int) -> float:
        """Images/s over ``batches`` batches, after taking the ``ready`` already prefetched."""
        for _ in range(ready):
            self.next()
        start, images = time.perf_counter(), 0
        for _ in range(batches):
            images += len(self.next()[0])
        return images / (time.perf_counter() - start)


def hand_loader(root: Path, workers: int, batch_size: int, augment: bool = False) -> Any:
    """What users write: ImageFolder, v2 transforms on PIL images, a pinned DataLoader;
    ``augment``: RandAugment after the flip, RandomErasing(p=0.25) after normalising."""
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import v2

    from trainkit.data.transforms import IMAGENET_MEAN, IMAGENET_STD

    transform = v2.Compose([v2.RandomResizedCrop(224), v2.RandomHorizontalFlip(),
                            *([v2.RandAugment()] if augment else []), v2.ToImage(),
                            v2.ToDtype(torch.float32, scale=True),
                            v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
                            *([v2.RandomErasing(p=0.25)] if augment else [])])
    return DataLoader(ImageFolder(str(root), transform=transform), batch_size=batch_size,
                      shuffle=True, num_workers=workers, pin_memory=torch.cuda.is_available(),
                      persistent_workers=workers > 0, drop_last=True)


def trainkit_loader(root: Path, workers: int, batch_size: int, augment: bool = False) -> Any:
    """The training loader of ``data=image_folder data.root=<root>``, on this machine's device;
    ``augment``: with ``data.auto_augment=randaugment data.random_erasing=0.25``."""
    from trainkit.config import DataConfig
    from trainkit.core.runtime import Runtime
    from trainkit.data import load_data

    cfg = DataConfig(name="image_folder", root=str(root), batch_size=batch_size,
                     num_workers=workers, random_flip=True,
                     val_fraction=0.0, drop_last=True,
                     auto_augment="randaugment" if augment else None,
                     random_erasing=0.25 if augment else 0.0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return load_data(cfg, Runtime.from_env(device))[0]


def webdataset_loader(root: Path, workers: int, batch_size: int) -> Any:
    """The training loader of ``data=webdataset`` on ``root``'s images as shards (written once,
    beside the folder), on this machine's device."""
    from trainkit.config import DataConfig
    from trainkit.core.runtime import Runtime
    from trainkit.data.pipeline import shard_loaders
    from trainkit.data.tools.shard_writer import write_shards

    shards = root.with_name(root.name + "-shards")
    if not (shards / "shards.json").is_file():
        per_shard = max(1, sum(1 for _ in root.glob("*/*.jpg")) // (4 * max(1, workers)))
        write_shards(root, shards, per_shard, val_fraction=0.0)
    cfg = DataConfig(name="webdataset", root=str(shards), batch_size=batch_size,
                     num_workers=workers, random_flip=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return shard_loaders(cfg, Runtime.from_env(device))[0]


def ceiling(files: list[str], batch_size: int, device: str) -> Callable[[int], float]:
    """Images/s of one process doing the loader's whole work on ``n`` files, with no loader:
    read, decode, crop and flip each (a worker's part), stack them in batches, and on a CPU
    normalise each batch to float32 (the part the prefetcher does where the batch lands; on a
    GPU that is the GPU's, off the CPU)."""
    from trainkit.data import transforms as tf
    from trainkit.data.sources.image_folder import collate_images

    transform = tf.train_transform(224)
    order = random.Random(0)

    def run(n: int) -> float:
        start = time.perf_counter()
        paths = order.sample(files, n)
        for first in range(0, n, batch_size):
            batch = collate_images([(transform(tf.load_image(path)), 0, [])
                                    for path in paths[first:first + batch_size]])
            if device == "cpu":
                tf.normalize(batch.images, tf.IMAGENET_MEAN, tf.IMAGENET_STD)
        return n / (time.perf_counter() - start)

    return run


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few batches of a few files")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=30, help="timed batches per measurement")
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.quick:
        args.images, args.batch_size, args.batches, args.rounds = 40, 8, 2, 1
    torch.set_num_threads(1)  # the ceiling is per core; loader workers run one thread each
    root = photo_folder(args.images)
    files = sorted(str(p) for p in root.glob("*/*.jpg"))
    streams = {"hand": Stream(hand_loader(root, args.workers, args.batch_size)),
               "trainkit": Stream(trainkit_loader(root, args.workers, args.batch_size)),
               "webdataset": Stream(webdataset_loader(root, args.workers, args.batch_size)),
               "hand+aug": Stream(hand_loader(root, args.workers, args.batch_size, True)),
               "trainkit+aug": Stream(trainkit_loader(root, args.workers, args.batch_size,
                                                      True))}
    ready = max(1, args.workers) * 2  # what the workers' prefetch holds when a turn starts
    for stream in streams.values():  # workers started and warm before any clock runs
        stream.rate(1, ready)
    per_core = ceiling(files, args.batch_size, "cuda" if torch.cuda.is_available() else "cpu")
    per_core(min(len(files), args.batch_size))
    samples = alternate({
        "hand": lambda: streams["hand"].rate(args.batches, ready),
        "trainkit": lambda: streams["trainkit"].rate(args.batches, ready),
        "ceiling": lambda: per_core(args.batches // 2 * args.batch_size),
        "webdataset": lambda: streams["webdataset"].rate(args.batches, ready),
        "hand+aug": lambda: streams["hand+aug"].rate(args.batches, ready),
        "trainkit+aug": lambda: streams["trainkit+aug"].rate(args.batches, ready),
    }, args.rounds)
    augmented = ratio(samples, "trainkit+aug", "hand+aug")
    aug_cost = ratio(samples, "trainkit+aug", "trainkit")
    shards_vs_files = ratio(samples, "webdataset", "trainkit")
    speedup = ratio(samples, "trainkit", "hand")
    # workers x ceiling: the rate of `workers` cores doing nothing but the work itself
    of_ceiling = ratio(samples, "trainkit", "ceiling") / max(1, args.workers)
    rates = {side: median(samples, side) for side in samples}
    print(f"images/s, {args.workers} workers, batch {args.batch_size}: hand "
          f"{rates['hand']:.0f}, trainkit {rates['trainkit']:.0f} ({speedup:.2f}x); one-process "
          f"ceiling {rates['ceiling']:.0f}/core, trainkit = {of_ceiling:.2f} x workers x "
          f"ceiling; webdataset {rates['webdataset']:.0f} ({shards_vs_files:.2f}x trainkit's); "
          f"RandAugment + erasing: hand {rates['hand+aug']:.0f}, trainkit "
          f"{rates['trainkit+aug']:.0f} ({augmented:.2f}x; {aug_cost:.2f}x plain trainkit) "
          f"(machine: {os.cpu_count()} logical cores, shared)", flush=True)
    return {
        "benchmark": "image_folder",
        "files": len(files), "workers": args.workers, "batch_size": args.batch_size,
        "images_per_s": rates, "samples": samples, "rounds": args.rounds,
        "ratios": {"trainkit/hand": speedup, "trainkit/(workers x ceiling)": of_ceiling,
                   "webdataset/trainkit": shards_vs_files,
                   "trainkit+aug/hand+aug": augmented, "trainkit+aug/trainkit": aug_cost},
        "goal": "trainkit >= 1.5x the hand-written loader's images/s at 2 workers; >= 0.85x "
                "workers x the one-process ceiling",
        "rows": [
            row("image_folder: trainkit/hand loader (JPEG)", speedup, ">= 1.5x",
                None if args.quick else speedup >= 1.5),
            row("image_folder: trainkit/(workers x ceiling)", of_ceiling, ">= 0.85x",
                None if args.quick else of_ceiling >= 0.85),
            row("image_folder + RandAugment + erasing: trainkit/hand", augmented, ">= 1x",
                None if args.quick else augmented >= 1.0),
        ],
    }


if __name__ == "__main__":
    emit(main())
