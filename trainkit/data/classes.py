"""Where a run keeps the names of its classes, for prediction, export and resumption.

* ``<run_dir>/classes.json``: ``{"classes": [name of class 0, name of class 1, ...]}``, written
  by rank 0 when an image-folder run starts (and before its first checkpoint).
* every checkpoint: ``checkpoint["data"]["classes"]``, the same list (the training loader's
  ``state_dict()``); a run resumed on data with other classes is refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trainkit.core.errors import TrainkitError

CLASSES_FILE = "classes.json"
STATE_KEY = "classes"  # in the data loader's state_dict, saved as checkpoint["data"]


def write_classes(run_dir: str | Path, classes: Sequence[str]) -> Path:
    """Write ``classes`` (index order) to ``<run_dir>/classes.json`` atomically; its path."""
    path = Path(run_dir) / CLASSES_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{CLASSES_FILE}.{os.getpid()}")
    partial.write_text(json.dumps({"classes": list(classes)}, indent=1) + "\n")
    os.replace(partial, path)
    return path


def read_classes(source: str | Path | Mapping[str, Any]) -> list[str] | None:
    """Class names by index from a run directory, a ``classes.json`` file, or a checkpoint's
    contents (a dict from ``torch.load``); None when it has none (a run on tensor data)."""
    if isinstance(source, Mapping):
        data = source.get("data")
        classes = data.get(STATE_KEY) if isinstance(data, Mapping) else None
        return list(classes) if classes is not None else None
    path = Path(source)
    if path.is_dir():
        path = path / CLASSES_FILE
    if not path.is_file():
        return None
    return list(json.loads(path.read_text())["classes"])


def check_same_classes(saved: Sequence[str] | None, live: Sequence[str]) -> None:
    """Refuse to resume a checkpoint trained on other classes, in one line.

    Raises:
        TrainkitError: the names or their order differ.
    """
    if saved is None or list(saved) == list(live):
        return
    saved, live = list(saved), list(live)
    gone, new = sorted(set(saved) - set(live)), sorted(set(live) - set(saved))
    what = (f"missing now: {_few(gone)}; new: {_few(new)}" if gone or new
            else "the same names in another order")
    raise TrainkitError(f"the checkpoint's classes differ from the data's ({what}): resume "
                        "with the same class folders, or start a new run")


def _few(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" (+{len(names) - 5})" if len(names) > 5 else "") or "none"
