"""A Hugging Face ``datasets`` split as a ``dataset._target_`` of ``python -m trainkit.train``.

The entry point calls a dataset node as ``reader(root=data.root, train=True/False)``;
:func:`load_split` answers that with a split of ``datasets.load_dataset(path, **kwargs)``, so
any dataset ``datasets`` loads from local files (parquet, arrow, ``imagefolder``, csv of paths,
a saved dataset) trains through the entry point::

    python -m trainkit.train data=image_folder data.root=/data/pets \\
        +dataset._target_=trainkit.data.hf.load_split +dataset.path=imagefolder

Evaluation takes the ``validation`` split, else ``test``, else a held-out ``val_fraction`` of
the training split (per class, seeded), as image folders without ``val/`` do. The image and
label columns are ``data.image_column`` / ``data.label_column``. Needs the ``datasets`` package
(``pip install trainkit[hf]``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainkit.core.errors import ConfigError, TrainkitError

EVAL_SPLITS = ("validation", "test")  # tried in this order when eval_split is not given


def load_split(root: str | None = None, train: bool = True, *, path: str,
               train_split: str = "train", eval_split: str | None = None,
               val_fraction: float = 0.1, seed: int = 0, **kwargs: Any) -> Any:
    """One split of ``datasets.load_dataset(path, **kwargs)`` (or ``load_from_disk(path)``).

    Args:
        root: ``data.root``; used as ``data_dir`` when neither it nor ``data_files`` is given.
        train: the training split, else the evaluation split.
        path: ``load_dataset``'s path: a builder (``parquet``, ``imagefolder``, ...) or a folder
            saved with ``save_to_disk`` (then loaded with ``load_from_disk``).
        train_split: the training split's name.
        eval_split: the evaluation split's name; None: ``validation``, else ``test``, else
            ``val_fraction`` of the training split held out (and left out of training).
        val_fraction, seed: the held-out fraction and the seed that picks it.
        kwargs: more ``load_dataset`` arguments (``data_files``, ``data_dir``, ``cache_dir``...).

    Raises:
        TrainkitError: ``datasets`` is not installed, or a split named is not in the dataset.
    """
    try:
        import datasets
    except ImportError:
        raise TrainkitError("a Hugging Face dataset needs the datasets package: "
                            "pip install 'trainkit[hf]'") from None
    if (Path(path) / "dataset_dict.json").is_file():  # saved with DatasetDict.save_to_disk
        splits = datasets.load_from_disk(path)
    else:
        if root and "data_files" not in kwargs and "data_dir" not in kwargs:
            kwargs["data_dir"] = root
        splits = datasets.load_dataset(path, **kwargs)
    names = list(splits)
    if eval_split is None:  # validation, else test, else None: held out of the training split
        eval_split = next((name for name in EVAL_SPLITS if name in names), None)
    for key, name in (("train_split", train_split), ("eval_split", eval_split)):
        if name is not None and name not in names:
            raise ConfigError(f"the dataset {path} has no split {name!r} (its splits: "
                              f"{', '.join(names)}): set +dataset.{key}= to one of them")
    if eval_split is None:
        return _hold_out(splits[train_split], val_fraction, seed)[0 if train else 1]
    return splits[train_split if train else eval_split]


def _hold_out(split: Any, fraction: float, seed: int) -> tuple[Any, Any]:
    """``split`` as (training, held-out ``fraction``), per class when a column is a
    ``ClassLabel`` (each class keeps its share, as image folders' ``val_fraction``)."""
    if not 0 < fraction < 1:
        raise ConfigError(f"dataset.val_fraction={fraction}: the dataset has no validation or "
                          "test split to evaluate on; hold out a fraction in (0, 1)")
    labels = [name for name, feature in split.features.items()
              if type(feature).__name__ == "ClassLabel"]
    parts = split.train_test_split(test_size=fraction, seed=seed,
                                   stratify_by_column=labels[0] if labels else None)
    return parts["train"], parts["test"]
