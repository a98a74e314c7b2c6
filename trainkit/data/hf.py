"""A Hugging Face ``datasets`` split as a ``dataset._target_`` of ``python -m trainkit.train``.

The entry point calls a dataset node as ``reader(root=data.root, train=True/False)``;
:func:`load_split` answers that with ``datasets.load_dataset(path, split=..., **kwargs)``, so any
dataset ``datasets`` loads from local files (parquet, arrow, ``imagefolder``, csv of paths, a
saved dataset) trains through the entry point::

    python -m trainkit.train data=image_folder dataset._target_=trainkit.data.hf.load_split \\
        +dataset.path=parquet +dataset.data_dir=/data/pets

The image and label columns are ``data.image_column`` / ``data.label_column``. Needs the
``datasets`` package (``pip install trainkit[hf]``).
"""

from __future__ import annotations

from typing import Any

from trainkit.core.errors import TrainkitError


def load_split(root: str | None = None, train: bool = True, *, path: str,
               train_split: str = "train", eval_split: str = "test", **kwargs: Any) -> Any:
    """``datasets.load_dataset(path, split=train_split or eval_split, **kwargs)``.

    Args:
        root: ``data.root``; used as ``data_dir`` when neither it nor ``data_files`` is given.
        train: the training split, else the evaluation split.
        path: ``load_dataset``'s path: a builder (``parquet``, ``imagefolder``, ...) or a folder
            saved with ``save_to_disk`` (then loaded with ``load_from_disk``).
        train_split, eval_split: the split names.
        kwargs: more ``load_dataset`` arguments (``data_files``, ``data_dir``, ...).

    Raises:
        TrainkitError: ``datasets`` is not installed.
    """
    try:
        import datasets
    except ImportError:
        raise TrainkitError("a Hugging Face dataset needs the datasets package: "
                            "pip install 'trainkit[hf]'") from None
    from pathlib import Path

    split = train_split if train else eval_split
    if (Path(path) / "dataset_dict.json").is_file():  # saved with DatasetDict.save_to_disk
        return datasets.load_from_disk(path)[split]
    if root and "data_files" not in kwargs and "data_dir" not in kwargs:
        kwargs["data_dir"] = root
    return datasets.load_dataset(path, split=split, **kwargs)
