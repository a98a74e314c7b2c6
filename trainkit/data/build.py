"""Build the training and evaluation loaders a :class:`~trainkit.config.DataConfig` describes."""

from __future__ import annotations

from trainkit.config import DataConfig
from trainkit.data.memory import InMemoryLoader
from trainkit.datasets import load_cifar10, load_mnist
from trainkit.errors import ConfigError
from trainkit.runtime import Runtime

READERS = {"mnist": load_mnist, "cifar10": load_cifar10}


def build_loaders(
    cfg: DataConfig, runtime: Runtime, *, seed: int = 0, channels_last: bool = False
) -> tuple[InMemoryLoader, InMemoryLoader, int]:
    """Training and evaluation loaders for the dataset ``cfg.name``, and its number of classes.

    Both serve the split from memory on ``runtime.device`` (GPU-resident on CUDA); only the
    training loader shuffles and augments (``cfg.random_crop_padding``, ``cfg.random_flip``).

    Raises:
        ConfigError: an unknown dataset name, or a batch size the data cannot fill.
        TrainkitError: the files are missing (offline), corrupt or malformed.
    """
    if cfg.name not in READERS:
        raise ConfigError(f"data.name={cfg.name!r} is not one of {', '.join(READERS)}")
    read = READERS[cfg.name]
    train = read(cfg.root, train=True, verify=cfg.verify, download=cfg.download)
    test = read(cfg.root, train=False, verify=cfg.verify, download=cfg.download)
    common = {"device": runtime.device, "rank": runtime.rank, "world_size": runtime.world_size,
              "channels_last": channels_last}
    return (
        InMemoryLoader(train, cfg.batch_size, shuffle=True, seed=seed, drop_last=cfg.drop_last,
                       padding=cfg.random_crop_padding, flip=cfg.random_flip,
                       pad_mode=cfg.pad_mode, **common),
        InMemoryLoader(test, cfg.eval_batch_size, shuffle=False, **common),
        train.num_classes,
    )
