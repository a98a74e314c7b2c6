"""The pipeline: a run's loaders from the Source its ``data.name`` picks.

:func:`load_data` looks the kind up (:func:`~trainkit.data.sources.source_of`), checks the keys
it reads, the device stage's preconditions (``data.decode=gpu``), and hands the source its own
typed config; it returns the training and evaluation loaders and the class count, which the
caller reads before it builds the model. The one module that sees every stage: a source
describes its splits (:mod:`trainkit.data.sources.source`), :func:`loader_of` makes each the loader
and device stage it needs, so no source imports a later stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from trainkit.config import SharedDataConfig, TokensConfig, WebDatasetConfig
from trainkit.core.errors import ConfigError
from trainkit.core.runtime import Runtime
from trainkit.data.device.gpu_decode import check_gpu_decode
from trainkit.data.device.prefetch import DevicePrefetcher
from trainkit.data.loader.memory import InMemoryLoader
from trainkit.data.loader.mixture import (
    EachSource,
    MixedTokenLoader,
    MixtureSampler,
    MixtureSamples,
)
from trainkit.data.loader.resumable import make_loader
from trainkit.data.loader.shards import ShardLoader
from trainkit.data.loader.tokens import TokenLoader
from trainkit.data.sources import OWN, own_config, refuse_unread, source_of
from trainkit.data.sources.mixture import mixture_splits
from trainkit.data.sources.source import (
    InMemory,
    Loaded,
    MapStyle,
    Mixture,
    Options,
    Reader,
    Shards,
    SplitPlan,
    TokenWindows,
)
from trainkit.data.sources.tokens import token_windows
from trainkit.data.sources.webdataset import Transforms, shard_splits


class Data(NamedTuple):
    """What a source gives: the loaders (``val`` may be None) and the number of classes."""

    train: Any
    val: Any
    num_classes: int


def load_data(cfg: SharedDataConfig, runtime: Runtime, *, seed: int = 0,
              channels_last: bool = False,
              reader: Reader | None = None,
              train_transforms: Sequence[Callable[..., Any]] | None = None,
              eval_transforms: Sequence[Callable[..., Any]] | None = None,
              eval_max_batches: int | None = None) -> Data:
    """The training and evaluation loaders of ``cfg.name``'s source, and its class count.

    ``cfg`` is the ``data`` node (:class:`~trainkit.config.DataConfig`, every source's keys)
    or a source's own typed config; the source gets its own part of it.

    ``reader`` (the entry point's ``dataset._target_``) replaces the built-in images: called
    as ``reader(root=cfg.root, train=...)``, it returns a
    :class:`~trainkit.data.sources.tensors.TensorData` or any map-style ``Dataset`` (torch's,
    or Hugging Face's). ``train_transforms`` / ``eval_transforms`` (callables) replace the
    default transforms of image files. ``eval_max_batches`` (``trainer.eval_max_batches``)
    bounds evaluation to that many batches per rank, spread evenly over the split.

    Raises:
        ConfigError: an unknown ``data.name``, a batch size the data cannot fill, or a
            ``data.num_classes`` other than the data's.
        TrainkitError: the files are missing (offline), corrupt or malformed.
    """
    source = source_of(cfg.name, own_reader=reader is not None)
    if getattr(cfg, "decode", "cpu") == "gpu":  # JPEGs decoded on the device: its preconditions
        check_gpu_decode(cfg, runtime.device, decodes_files=source.gpu_decode,
                         custom_transforms=bool(train_transforms or eval_transforms))
    refuse_unread(cfg, source.config, "your dataset (dataset._target_)" if source is OWN
                  else f"data={cfg.name}")
    options = Options(seed, channels_last, reader, train_transforms, eval_transforms,
                      eval_max_batches)
    own = own_config(cfg, source.config)
    loaded = (mixture_splits(own, source, runtime, options) if getattr(own, "mix", None)
              else source.load(own, runtime, options))
    data = loaders_of(loaded, runtime, options)
    if cfg.num_classes is not None and cfg.num_classes != data.num_classes:
        raise ConfigError(f"data.num_classes={cfg.num_classes} but the data has "
                          f"{data.num_classes} classes: leave data.num_classes unset (null), "
                          "it is read from the data")
    return data


build_loaders = load_data  # the name trainkit's API has had


def loaders_of(loaded: Loaded, runtime: Runtime, options: Options) -> Data:
    """A source's described splits (:data:`~trainkit.data.sources.source.Loaded`) as loaders."""
    train, val, num_classes = loaded
    return Data(loader_of(train, runtime, options),
                loader_of(val, runtime, options) if val is not None else None, num_classes)


def loader_of(plan: SplitPlan, runtime: Runtime, options: Options) -> Any:
    """One split's loader and device stage, as its description asks."""
    where = {"device": runtime.device, "rank": runtime.rank, "world_size": runtime.world_size}
    if isinstance(plan, InMemory):
        return InMemoryLoader(plan.data, plan.batch_size, shuffle=plan.shuffle,
                              seed=options.seed, drop_last=plan.drop_last, padding=plan.padding,
                              flip=plan.flip, pad_mode=plan.pad_mode,
                              max_batches=plan.max_batches, channels_last=options.channels_last,
                              repeats=plan.repeats, **where)
    if isinstance(plan, TokenWindows):
        return TokenLoader(plan.path, plan.seq_len, plan.batch_size, shuffle=plan.shuffle,
                           dtype=plan.dtype, seed=options.seed, max_batches=plan.max_batches,
                           **where)
    if isinstance(plan, Mixture):
        return mixture_loader(plan, runtime, options)
    if isinstance(plan, Shards):
        loader: Any = ShardLoader(plan.stream, num_workers=plan.num_workers,
                                  batches=plan.batches)
        return DevicePrefetcher(loader, runtime.device, mean=plan.mean, std=plan.std,
                                classes=plan.classes, channels_last=options.channels_last,
                                normalize_float=False)
    if not isinstance(plan, MapStyle):
        raise TypeError(f"not a split's description: {type(plan).__name__}")
    return map_style_loader(plan, runtime, options)


def map_style_loader(plan: MapStyle, runtime: Runtime, options: Options,
                     sampler: Any = None) -> DevicePrefetcher:
    """A map-style split's resumable DataLoader (in ``sampler``'s order when given) and device
    stage."""
    where = {"device": runtime.device, "rank": runtime.rank, "world_size": runtime.world_size}
    decoder = None
    if plan.decode is not None:
        from trainkit.data.device.gpu_decode import JpegDecoder

        decoder = JpegDecoder(runtime.device, channels=plan.decode.channels,
                              transform=plan.decode.transform,
                              skip_corrupt=plan.decode.skip_corrupt)
    loader = make_loader(plan.dataset, plan.batch_size, shuffle=plan.shuffle,
                         seed=options.seed, num_workers=plan.num_workers,
                         pin_memory=plan.pin_memory, drop_last=plan.drop_last,
                         collate_fn=plan.collate_fn, max_batches=plan.max_batches,
                         sampler=sampler, repeats=plan.repeats, **where)
    return DevicePrefetcher(loader, runtime.device, mean=plan.mean, std=plan.std,
                            classes=plan.classes, channels_last=options.channels_last,
                            normalize_float=plan.normalize_float, decoder=decoder)


def mixture_loader(plan: Mixture, runtime: Runtime, options: Options) -> Any:
    """A mixture's loader: a training split's samples drawn by weight from its parts, or an
    evaluation split's parts apart (:class:`EachSource`)."""
    first = plan.parts[0]
    if not first.shuffle:
        return EachSource({name: loader_of(part, runtime, options)
                           for name, part in zip(plan.names, plan.parts)})
    if isinstance(first, TokenWindows):
        return MixedTokenLoader([loader_of(part, runtime, options) for part in plan.parts],
                                plan.weights, seed=options.seed)
    dataset = MixtureSamples([part.dataset for part in plan.parts])
    sampler = MixtureSampler(dataset.sizes, plan.weights, first.batch_size,
                             drop_last=first.drop_last, seed=options.seed, rank=runtime.rank,
                             world_size=runtime.world_size)
    return map_style_loader(replace(first, dataset=dataset), runtime, options, sampler)


def token_loaders(cfg: TokensConfig, runtime: Runtime, *, seed: int = 0,
                  eval_max_batches: int | None = None) -> tuple[TokenLoader, TokenLoader, int]:
    """``data=tokens``'s training and evaluation loaders and vocabulary size
    (:func:`~trainkit.data.sources.tokens.token_windows`, served)."""
    return loaders_of(token_windows(cfg, eval_max_batches=eval_max_batches), runtime,
                 Options(seed=seed))


def shard_loaders(cfg: WebDatasetConfig, runtime: Runtime, *, seed: int = 0,
                  channels_last: bool = False, train_transforms: Transforms = None,
                  eval_transforms: Transforms = None) -> tuple[DevicePrefetcher, Any, int]:
    """``data=webdataset``'s training and validation loaders and class count
    (:func:`~trainkit.data.sources.webdataset.shard_splits`, served); ``train_transforms`` /
    ``eval_transforms`` replace the default transforms when given."""
    return loaders_of(shard_splits(cfg, runtime, seed=seed, train_transforms=train_transforms,
                              eval_transforms=eval_transforms), runtime,
                 Options(seed=seed, channels_last=channels_last))
