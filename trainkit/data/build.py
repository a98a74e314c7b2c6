"""Build the training and evaluation loaders a :class:`~trainkit.config.DataConfig` describes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from trainkit.config import DataConfig
from trainkit.core.errors import ConfigError
from trainkit.core.runtime import Runtime
from trainkit.data.datasets import TensorData, load_cifar10, load_mnist
from trainkit.data.device.gpu_decode import check_gpu_decode
from trainkit.data.device.prefetch import DevicePrefetcher
from trainkit.data.hf_text import hf_text_loaders
from trainkit.data.loader.memory import InMemoryLoader
from trainkit.data.loader.resumable import make_loader
from trainkit.data.own_data import dataset_loaders, image_folder_loaders
from trainkit.data.shards import shard_loaders
from trainkit.data.tokens import token_loaders

READERS = {"mnist": load_mnist, "cifar10": load_cifar10}  # the built-in datasets, by data.name
# A user's own dataset: called as ``reader(root=data.root, train=True/False)``, returns one split:
Reader = Callable[..., Any]  # TensorData, a torch Dataset or a datasets.Dataset


def build_loaders(
    cfg: DataConfig, runtime: Runtime, *, seed: int = 0, channels_last: bool = False,
    reader: Reader | None = None, train_transforms: Sequence[Callable[..., Any]] | None = None,
    eval_transforms: Sequence[Callable[..., Any]] | None = None,
    eval_max_batches: int | None = None,
) -> tuple[Any, Any, int]:
    """Training and evaluation loaders for the dataset ``cfg.name``, and its number of classes.

    ``reader`` replaces the built-in datasets with your own: ``reader(root=cfg.root, train=...)``
    returns a :class:`~trainkit.data.datasets.TensorData` (uint8 images ``[N, C, H, W]``, int64
    labels, per-channel mean/std in 0..1, the number of classes); ``cfg.name`` then only names it.
    The entry point builds it from the config's ``dataset`` node (``_target_`` and its keys).

    ``data.name=image_folder`` reads an image folder at ``cfg.root``, and a ``reader`` may also
    return any map-style ``Dataset`` (torch's, or Hugging Face's ``datasets.Dataset``): both
    load through workers (:mod:`trainkit.data.own_data`), with ``train_transforms`` /
    ``eval_transforms`` (callables) replacing the default transforms when given.

    ``data.loader=memory`` (the default) serves each split from memory on ``runtime.device``
    (GPU-resident on CUDA) and augments whole batches there. ``data.loader=dataloader`` is the
    standard path: a DataLoader with ``data.num_workers`` workers transforming one image at a
    time, pinned memory on CUDA, and a :class:`DevicePrefetcher` that copies and normalises on
    the device. Only the training loader shuffles and augments (``data.random_crop_padding``,
    ``data.random_flip``); both resume mid-epoch exactly.

    ``eval_max_batches`` (``trainer.eval_max_batches``) bounds the evaluation loader to that
    many batches per rank, of samples (or a corpus's windows) spread evenly over the split: a
    fixed, representative sample, the same at every evaluation (image shards: their first
    batches, as they stream).

    Raises:
        ConfigError: an unknown dataset name, or a batch size the data cannot fill.
        TrainkitError: the files are missing (offline), corrupt or malformed.
    """
    if cfg.decode == "gpu":  # JPEGs decoded on the device: its preconditions, one line each
        check_gpu_decode(cfg, runtime.device, own_dataset=reader is not None,
                         custom_transforms=bool(train_transforms or eval_transforms))
    if cfg.name == "tokens":  # a token corpus: windows from memory-mapped files
        return token_loaders(cfg, runtime, seed=seed,  # type: ignore[return-value]
                             eval_max_batches=eval_max_batches)
    if cfg.name == "hf_text":  # text tokenised for a Hugging Face model
        return hf_text_loaders(cfg, runtime, seed=seed,  # type: ignore[return-value]
                               eval_max_batches=eval_max_batches)
    own = {"seed": seed, "channels_last": channels_last, "train_transforms": train_transforms,
           "eval_transforms": eval_transforms}
    if cfg.name == "webdataset":  # image shards streamed by every rank and worker
        return shard_loaders(cfg, runtime, **own)
    if reader is None and cfg.name == "image_folder":
        return image_folder_loaders(cfg, runtime, eval_max_batches=eval_max_batches, **own)
    if reader is not None:
        train, test = reader(root=cfg.root, train=True), reader(root=cfg.root, train=False)
        if not isinstance(train, TensorData):
            return dataset_loaders(train, test, cfg, runtime, eval_max_batches=eval_max_batches,
                                   **own)
    elif cfg.name not in READERS:
        raise ConfigError(f"data.name={cfg.name!r} is not one of {', '.join(READERS)}, "
                          "image_folder, tokens, webdataset, hf_text; "
                          "for your own dataset set dataset._target_ (see the README)")
    else:
        read = READERS[cfg.name]
        train = read(cfg.root, train=True, verify=cfg.verify, download=cfg.download)
        test = read(cfg.root, train=False, verify=cfg.verify, download=cfg.download)
    if cfg.loader == "dataloader":
        return (_dataloader(train, cfg, runtime, seed, channels_last, training=True),
                _dataloader(test, cfg, runtime, seed, channels_last, training=False,
                            max_batches=eval_max_batches),
                train.num_classes)
    common = {"device": runtime.device, "rank": runtime.rank, "world_size": runtime.world_size,
              "channels_last": channels_last}
    return (
        InMemoryLoader(train, cfg.batch_size, shuffle=True, seed=seed, drop_last=cfg.drop_last,
                       padding=cfg.random_crop_padding, flip=cfg.random_flip,
                       pad_mode=cfg.pad_mode, **common),
        InMemoryLoader(test, cfg.eval_batch_size, shuffle=False, max_batches=eval_max_batches,
                       **common),
        train.num_classes,
    )


class ImageSamples(Dataset):
    """A split as a map-style dataset of ``(uint8 image, label)``, augmented one image at a time
    with torchvision's transforms (the standard per-sample path)."""

    def __init__(self, data: TensorData, *, padding: int = 0, flip: bool = False,
                 pad_mode: str = "constant") -> None:
        from torchvision.transforms import v2  # heavy import: only on this path

        self.images, self.labels = data.images, data.labels
        ops: list[Any] = []
        if padding:
            size = tuple(data.images.shape[-2:])
            ops.append(v2.RandomCrop(size, padding=padding, padding_mode=pad_mode))
        if flip:
            ops.append(v2.RandomHorizontalFlip())
        self.transform = v2.Compose(ops) if ops else None

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[i]
        return (self.transform(image) if self.transform else image), self.labels[i]


def _dataloader(data: TensorData, cfg: DataConfig, runtime: Runtime, seed: int,
                channels_last: bool, *, training: bool,
                max_batches: int | None = None) -> DevicePrefetcher:
    samples = ImageSamples(data, padding=cfg.random_crop_padding, flip=cfg.random_flip,
                           pad_mode=cfg.pad_mode) if training else ImageSamples(data)
    loader = make_loader(
        samples, cfg.batch_size if training else cfg.eval_batch_size, shuffle=training,
        device=runtime.device, seed=seed, rank=runtime.rank, world_size=runtime.world_size,
        num_workers=cfg.num_workers, pin_memory=cfg.pin_memory,
        drop_last=cfg.drop_last and training, max_batches=max_batches)
    return DevicePrefetcher(loader, runtime.device, mean=data.mean, std=data.std,
                            channels_last=channels_last)
