"""The sources: one module per kind of data, each its dataset (and loaders) from its own config.

:data:`SOURCES` is the one table, keyed by ``data.name``: each kind's
:class:`~trainkit.data.sources.source.Source` (its typed config, its ``load``, and its answers
to the commands: :func:`source_of`). :func:`load_data` looks the kind
up, hands it its config, and returns the training and evaluation loaders and the class count,
which the caller reads before it builds the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import MISSING, fields
from typing import Any, NamedTuple

from trainkit.config import DataConfig, SharedDataConfig
from trainkit.core.errors import ConfigError
from trainkit.core.runtime import Runtime
from trainkit.data.sources import (
    dataset,
    hf_text,
    image_folder,
    npy_folder,
    tensors,
    tokens,
    webdataset,
)
from trainkit.data.sources.source import Options, Reader, Source


class Data(NamedTuple):
    """What a source gives: the loaders (``val`` may be None) and the number of classes."""

    train: Any
    val: Any
    num_classes: int


SOURCES: dict[str, Source] = {source.name: source for source in (  # data.name -> its source
    tensors.MNIST, tensors.CIFAR10, image_folder.SOURCE, tokens.SOURCE, webdataset.SOURCE,
    hf_text.SOURCE, npy_folder.SOURCE)}
OWN = dataset.SOURCE  # a reader (dataset._target_) replaces the image kinds


def source_of(name: str, *, own_reader: bool = False) -> Source:
    """The :class:`Source` of ``data.name`` (with ``own_reader``: your ``dataset._target_``'s,
    which replaces the image kinds).

    Raises:
        ConfigError: an unknown ``data.name``.
    """
    source = SOURCES.get(name)
    if own_reader and (source is None or source.reader_replaces):
        return OWN
    if source is None:
        raise ConfigError(f"data.name={name!r} is not one of {', '.join(SOURCES)}; "
                          "for your own dataset set dataset._target_ (see the README)")
    return source


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
        from trainkit.data.device.gpu_decode import check_gpu_decode

        check_gpu_decode(cfg, runtime.device, decodes_files=source.gpu_decode,
                         custom_transforms=bool(train_transforms or eval_transforms))
    refuse_unread(cfg, source.config, "your dataset (dataset._target_)" if source is OWN
                  else f"data={cfg.name}")
    options = Options(seed, channels_last, reader, train_transforms, eval_transforms,
                      eval_max_batches)
    data = Data(*source.load(own_config(cfg, source.config), runtime, options))
    if cfg.num_classes is not None and cfg.num_classes != data.num_classes:
        raise ConfigError(f"data.num_classes={cfg.num_classes} but the data has "
                          f"{data.num_classes} classes: leave data.num_classes unset (null), "
                          "it is read from the data")
    return data


build_loaders = load_data  # the name trainkit's API has had


READ_BY_EVERY_SOURCE = {"channels"}  # the model's stem is built for it, whatever the data


def refuse_unread(cfg: Any, kind: type[SharedDataConfig], reader: str) -> None:
    """A key of the ``data`` node that ``kind``'s source does not read, set to other than its
    default (``data=tokens data.image_size=64``), is refused in one line: it would be ignored."""
    if not isinstance(cfg, DataConfig):
        return
    own = {f.name for f in fields(kind)} | READ_BY_EVERY_SOURCE
    for f in fields(DataConfig):
        if f.name in own:
            continue
        default = f.default if f.default is not MISSING else f.default_factory()
        value = getattr(cfg, f.name)
        if value != default:
            raise ConfigError(f"data.{f.name}={value!r} is not read by {reader}: remove it "
                              "(it is a key of another kind of data)")


def own_config(cfg: Any, kind: type[SharedDataConfig]) -> Any:
    """The part of ``cfg`` (the ``data`` node's every key) that a source of ``kind`` reads:
    a ``kind`` of the shared fields and the source's own."""
    if isinstance(cfg, kind):
        return cfg
    return kind(**{f.name: getattr(cfg, f.name) for f in fields(kind)})
