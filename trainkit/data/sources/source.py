"""What a kind of data is to the rest of trainkit: one :class:`Source`, asked, never switched on.

Each source module declares its :class:`Source` (MNIST's and CIFAR-10's are two of
``tensors``); :data:`trainkit.data.sources.SOURCES` lists them by ``data.name``. The commands
ask it what they used to decide by name: what its model takes (:attr:`Source.takes`), a batch
of the shape training gives the step (:meth:`Source.example_batch`, for estimate and probe),
the bytes ``data.loader=memory`` keeps on the device (:attr:`Source.resident_bytes`), a whole
split (:attr:`Source.read_split`, for predict and export), and its typed config.

A source builds no loader: its ``load`` describes each split (:class:`InMemory`,
:class:`MapStyle`, :class:`TokenWindows`, :class:`Shards`, a :class:`Mixture` of them: the
datasets and the kind of loader they need), and :mod:`trainkit.data.pipeline` builds the loader
and the device stage from the description, so that no source imports a later stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainkit.config import SharedDataConfig
from trainkit.core.runtime import Runtime

# A user's own dataset: called as ``reader(root=data.root, train=True/False)``, returns one split:
Reader = Callable[..., Any]  # TensorData, a torch Dataset or a datasets.Dataset


@dataclass(frozen=True)
class InMemory:
    """A split held as uint8 tensors, gathered and augmented on the device (``InMemoryLoader``)."""

    data: Any  # TensorData
    batch_size: int
    shuffle: bool
    drop_last: bool = False
    padding: int = 0
    flip: bool = False
    pad_mode: str = "constant"
    max_batches: int | None = None
    repeats: int = 1  # data.repeated_aug (training)


@dataclass(frozen=True)
class GpuDecode:
    """``data.decode=gpu``: the collated JPEG bytes decoded on the device, then ``transform``."""

    channels: int
    transform: Callable[..., Any] | None
    skip_corrupt: bool


@dataclass(frozen=True)
class MapStyle:
    """A map-style dataset through the resumable DataLoader (workers, a rank's shard, pinned
    memory) into the device stage (copy, bad-file check, normalisation with ``mean``/``std``)."""

    dataset: Any
    batch_size: int
    shuffle: bool
    num_workers: int | None = None
    pin_memory: bool | None = None
    drop_last: bool = False
    collate_fn: Callable[[list[Any]], Any] | None = None
    max_batches: int | None = None
    mean: Sequence[float] | None = None
    std: Sequence[float] | None = None
    classes: Sequence[str] | None = None
    normalize_float: bool = True
    decode: GpuDecode | None = None
    repeats: int = 1  # data.repeated_aug (training)


@dataclass(frozen=True)
class TokenWindows:
    """Windows of ``seq_len + 1`` tokens of a memory-mapped token file (``TokenLoader``)."""

    path: Path
    seq_len: int
    batch_size: int
    shuffle: bool
    dtype: str = "uint16"
    max_batches: int | None = None


@dataclass(frozen=True)
class Shards:
    """A stream of tar shards read by ``num_workers`` persistent workers (``ShardLoader``)
    into the device stage; ``batches`` per pass (None: unknown)."""

    stream: Any  # the source's IterableDataset, with settable ``epoch`` and ``start``
    num_workers: int
    batches: int | None
    mean: Sequence[float] | None = None
    std: Sequence[float] | None = None
    classes: Sequence[str] | None = None


@dataclass(frozen=True)
class Mixture:
    """Several corpora's splits of one kind (``data.mix``): a training split draws each sample
    from one of ``parts`` by ``weights`` (:mod:`trainkit.data.loader.mixture`); an evaluation
    split evaluates each part apart, as ``val/loss/<name>``."""

    names: tuple[str, ...]
    parts: tuple[MapStyle | TokenWindows, ...]
    weights: tuple[float, ...]  # summing to 1


SplitPlan = InMemory | MapStyle | TokenWindows | Shards | Mixture  # one split's description
# the training split, the evaluation split (or None), the class count
Loaded = tuple[SplitPlan, SplitPlan | None, int]


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


def config_shape(data: Any) -> tuple[int, int, int]:
    """An image source's sample shape as its config sets it: channels, image size squared."""
    return (data.channels, data.image_size, data.image_size)


@dataclass(frozen=True)
class Source:
    """A kind of data: its typed config, its splits, and its answers to the other commands.

    Args:
        name: its ``data.name`` (the YAML in ``configs/data/`` of that name selects it).
        config: its typed config (the shared fields and its own, :mod:`trainkit.config`).
        load: ``load(config, runtime, options)`` -> the training split's description, the
            evaluation split's (or None), the class count (:data:`Loaded`).
        takes: what its model takes: ``images`` (a classifier), ``tokens`` (a language model
            from token ids), ``text`` (a Hugging Face model with the run's tokenizer).
        shape: ``shape(data)``, an image sample's ``(C, H, W)`` without reading the data.
        num_classes: the class count where the kind fixes it (MNIST's 10), else None.
        classes_on_disk: ``classes_on_disk(root)``, the class count the files say cheaply, or
            None.
        read_split: ``read_split(data, train=...)``, a whole split as a ``TensorData`` (the
            inputs predict and export read), or None where the kind has no such split.
        split_files: ``split_files(data, seed, train=...)``, the image files of the run's own
            split (predict's ``inputs=test``), or None for a kind not made of files.
        resident_bytes: bytes ``data.loader=memory`` keeps on the device (0: not in memory).
        in_memory: ``data.loader=memory`` can hold it.
        eval_split: the evaluation split's name in the done line (``test`` or ``validation``).
        gpu_decode: ``data.decode=gpu`` may decode its JPEGs.
        reader_replaces: your ``dataset._target_`` replaces it (the built-in images; a stream
            of shards or tokens never takes a reader).
    """

    name: str
    config: type[SharedDataConfig]
    load: Callable[[Any, Runtime, Options], Loaded]
    takes: str = "images"
    shape: Callable[[Any], tuple[int, int, int]] = config_shape
    num_classes: int | None = None
    classes_on_disk: Callable[[Path], int | None] | None = None
    read_split: Callable[..., Any] | None = None
    split_files: Callable[..., list[str]] | None = None
    resident_bytes: int = 0
    in_memory: bool = False
    eval_split: str = "validation"
    gpu_decode: bool = False
    reader_replaces: bool = True

    def estimable(self) -> bool:
        """Whether :meth:`example_batch` can make its batches (images and token windows)."""
        return self.takes in ("images", "tokens")

    def known_classes(self, root: str | Path) -> int | None:
        """The class count known without loading: the kind's own, else the files' (cheaply)."""
        if self.num_classes is not None:
            return self.num_classes
        return self.classes_on_disk(Path(root)) if self.classes_on_disk is not None else None

    def example_batch(self, data: Any, size: int, *, channels_last: bool = False,
                      device: torch.device | str = "meta") -> Callable[[], Any]:
        """A maker of batches of ``size`` samples shaped as this data gives them to the step
        (zeros; on the meta device by default: the memory estimate's trace)."""
        if self.takes == "tokens":
            return lambda: {"tokens": torch.zeros(size, data.seq_len + 1, dtype=torch.long,
                                                  device=device)}
        if self.takes != "images":
            raise ValueError(f"data={self.name}: no example batch of {self.takes}")
        shape = self.shape(data)
        layout = torch.channels_last if channels_last else torch.contiguous_format

        def make() -> Any:
            images = torch.zeros(size, *shape, device=device).contiguous(memory_format=layout)
            return images, torch.zeros(size, dtype=torch.long, device=device)

        return make
