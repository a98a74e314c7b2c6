"""The sources: one module per kind of data, each a dataset (and its loaders) from its config.

:data:`SOURCES` is the one table, keyed by ``data.name``; :func:`load_data` looks the kind up
and returns the training and evaluation loaders and the class count, which the caller reads
before it builds the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from trainkit.config import DataConfig
from trainkit.core.errors import ConfigError
from trainkit.core.runtime import Runtime
from trainkit.data.sources import dataset, hf_text, image_folder, tensors, tokens, webdataset

# A user's own dataset: called as ``reader(root=data.root, train=True/False)``, returns one split:
Reader = Callable[..., Any]  # TensorData, a torch Dataset or a datasets.Dataset


class Data(NamedTuple):
    """What a source gives: the loaders (``val`` may be None) and the number of classes."""

    train: Any
    val: Any
    num_classes: int


@dataclass(frozen=True)
class Options:
    """What every source may take besides its config: the run's seed and layout, your own
    reader and transforms (built callables), and a bound on evaluation batches per rank."""

    seed: int = 0
    channels_last: bool = False
    reader: Reader | None = None
    train_transforms: Sequence[Callable[..., Any]] | None = None
    eval_transforms: Sequence[Callable[..., Any]] | None = None
    eval_max_batches: int | None = None


Source = Callable[[DataConfig, Runtime, Options], tuple[Any, Any, int]]
# data.name -> the source that builds it; a reader (dataset._target_) replaces the image kinds'
SOURCES: dict[str, Source] = {
    "mnist": tensors.load,
    "cifar10": tensors.load,
    "image_folder": image_folder.load,
    "tokens": tokens.load,
    "webdataset": webdataset.load,
    "hf_text": hf_text.load,
}
STREAMED = ("webdataset", "tokens", "hf_text")  # kinds that never take a reader


def load_data(cfg: DataConfig, runtime: Runtime, *, seed: int = 0, channels_last: bool = False,
              reader: Reader | None = None,
              train_transforms: Sequence[Callable[..., Any]] | None = None,
              eval_transforms: Sequence[Callable[..., Any]] | None = None,
              eval_max_batches: int | None = None) -> Data:
    """The training and evaluation loaders of ``cfg.name``'s source, and its class count.

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
    if cfg.decode == "gpu":  # JPEGs decoded on the device: its preconditions, one line each
        from trainkit.data.device.gpu_decode import check_gpu_decode  # (imports image_folder)

        check_gpu_decode(cfg, runtime.device, own_dataset=reader is not None,
                         custom_transforms=bool(train_transforms or eval_transforms))
    source = SOURCES.get(cfg.name)
    if reader is not None and cfg.name not in STREAMED:
        source = dataset.load
    if source is None:
        raise ConfigError(f"data.name={cfg.name!r} is not one of {', '.join(SOURCES)}; "
                          "for your own dataset set dataset._target_ (see the README)")
    options = Options(seed, channels_last, reader, train_transforms, eval_transforms,
                      eval_max_batches)
    data = Data(*source(cfg, runtime, options))
    if cfg.num_classes is not None and cfg.num_classes != data.num_classes:
        raise ConfigError(f"data.num_classes={cfg.num_classes} but the data has "
                          f"{data.num_classes} classes: leave data.num_classes unset (null), "
                          "it is read from the data")
    return data


build_loaders = load_data  # the name trainkit's API has had
