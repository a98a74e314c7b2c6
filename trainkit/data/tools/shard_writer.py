"""``python -m trainkit.data shards <image_folder> <out_dir> --samples-per-shard N``: an image
folder (``train/<class>/``, ``val/<class>/``, as ``data=image_folder`` reads it) as webdataset
shards for ``data=webdataset``.

Each split's files, in an order shuffled once (seed 0: shards mix the classes), go into
``train-000000.tar``, ``train-000001.tar``, ... of ``N`` samples (the last one may hold fewer):
the image file's bytes as they are (``<key>.jpg``, ``.png``, ...) and its class index
(``<key>.cls``), the key being the file's path under its split without the suffix. Beside
them, ``shards.json``: each shard's file name and sample count, and the class names.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from trainkit.core.errors import ConfigError
from trainkit.data.sources.image_folder import Split, read_image_folder
from trainkit.data.sources.webdataset import INDEX, _webdataset


def write_shards(folder: str | Path, out_dir: str | Path, samples_per_shard: int, *,
                 val_fraction: float = 0.1) -> dict[str, Any]:
    """Write the shards of ``folder``'s splits to ``out_dir``; return the index written.

    Raises:
        ConfigError: a bad shard size, or ``out_dir`` holds shards already (nothing is
            overwritten).
        TrainkitError: the folder is not an image folder (:func:`read_image_folder`).
    """
    if samples_per_shard < 1:
        raise ConfigError(f"--samples-per-shard must be >= 1, got {samples_per_shard}")
    out = Path(out_dir)
    if (out / INDEX).exists() or any(out.glob("*.tar")):
        raise ConfigError(f"{out} holds shards already: give another output folder (nothing "
                          "was overwritten)")
    data = read_image_folder(folder, val_fraction=val_fraction)
    out.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {"classes": data.classes}
    for name, split in (("train", data.train), ("val", data.val)):
        if split is not None:
            index[name] = _write_split(split, Path(folder), out, name, samples_per_shard)
    (out / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    return index


def _write_split(split: Split, root: Path, out: Path, name: str,
                 per_shard: int) -> list[dict[str, Any]]:
    wds = _webdataset()
    order = list(range(len(split.files)))
    random.Random(0).shuffle(order)
    entries: list[dict[str, Any]] = []
    for first in range(0, len(order), per_shard):
        shard = f"{name}-{len(entries):06d}.tar"
        with wds.TarWriter(str(out / shard)) as sink:
            for i in order[first:first + per_shard]:
                path = Path(split.files[i])
                sink.write({"__key__": _key(path, root), path.suffix[1:].lower():
                            path.read_bytes(), "cls": str(split.labels[i])})
        entries.append({"shard": shard, "samples": len(order[first:first + per_shard])})
    return entries


def _key(path: Path, root: Path) -> str:
    """The file's path under the folder, without its suffix; dots made underscores (webdataset
    takes a key up to the first dot of the file's name)."""
    relative = path.relative_to(root) if path.is_relative_to(root) else Path(path.name)
    return str(relative.with_suffix("")).replace(".", "_")
