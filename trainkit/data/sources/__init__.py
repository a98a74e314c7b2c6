"""The sources: one module per kind of data, each its dataset (and loaders) from its own config.

:data:`SOURCES` is the one table, keyed by ``data.name``: each kind's
:class:`~trainkit.data.sources.source.Source` (its typed config, its ``load``, and its answers
to the commands: :func:`source_of`). :func:`trainkit.data.pipeline.load_data` builds a run's
loaders from the one ``data.name`` picks. :func:`load_data` looks the kind
up, hands it its config, and returns the training and evaluation loaders and the class count,
which the caller reads before it builds the model.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any

from trainkit.config import DataConfig, SharedDataConfig
from trainkit.core.errors import ConfigError
from trainkit.data.sources import (
    dataset,
    hf_text,
    image_folder,
    npy_folder,
    tensors,
    tokens,
    webdataset,
)
from trainkit.data.sources.source import Options, Reader, Source  # noqa: F401  (their API)

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
