"""The pipeline: a run's loaders from the Source its ``data.name`` picks.

:func:`load_data` looks the kind up (:func:`~trainkit.data.sources.source_of`), checks the keys
it reads, the device stage's preconditions (``data.decode=gpu``), and hands the source its own
typed config; it returns the training and evaluation loaders and the class count, which the
caller reads before it builds the model. The one module that sees every stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from trainkit.config import SharedDataConfig
from trainkit.core.errors import ConfigError
from trainkit.core.runtime import Runtime
from trainkit.data.device.gpu_decode import check_gpu_decode
from trainkit.data.sources import OWN, own_config, refuse_unread, source_of
from trainkit.data.sources.source import Options, Reader


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
    data = Data(*source.load(own_config(cfg, source.config), runtime, options))
    if cfg.num_classes is not None and cfg.num_classes != data.num_classes:
        raise ConfigError(f"data.num_classes={cfg.num_classes} but the data has "
                          f"{data.num_classes} classes: leave data.num_classes unset (null), "
                          "it is read from the data")
    return data


build_loaders = load_data  # the name trainkit's API has had
