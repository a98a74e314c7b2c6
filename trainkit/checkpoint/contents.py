"""What a checkpoint must agree with: its producer (the manifest), the run's config, the model.

Shared by both storages: a ``.pt`` file and a sharded directory are checked by the same rules.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import platform
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import torch

from trainkit.config import flatten
from trainkit.core.errors import LINE_LIMIT, TrainkitError

log = logging.getLogger("trainkit")


def manifest(config: Mapping[str, Any]) -> dict[str, Any]:
    """What produced a checkpoint: versions, host, git commit and a hash of the resolved config."""
    canonical = json.dumps(config, sort_keys=True, default=str)
    return {
        "trainkit": trainkit_version(),
        "torch": str(torch.__version__),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "argv": list(sys.argv),
        "git": _git_commit(),
        "config_sha256": hashlib.sha256(canonical.encode()).hexdigest(),
    }


@functools.cache
def trainkit_version() -> str:
    """trainkit's version from its installed distribution's metadata (read, not imported from
    the package's top, which this layer sits below); ``"unknown"`` when the code runs from a
    source tree that was never installed."""
    try:
        return importlib.metadata.version("trainkit")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# Config keys whose change makes a checkpoint unusable for this run (others only warn).
MUST_MATCH = ("model", "data.name", "trainer.precision")
STARTS_ONLY = ("model.pretrained",)  # where a run's weights started: its checkpoint's win since


def check_config(state: Mapping[str, Any], run_config: Mapping[str, Any]) -> None:
    """Refuse a checkpoint of another model, dataset or precision; warn about other changes.

    Raises:
        TrainkitError: a :data:`MUST_MATCH` key differs; the message names it.
    """
    saved = state.get("config") or {}
    if not saved or not run_config:
        return
    changes = config_changes(saved, run_config)
    fatal = [c for c in changes if c.startswith(MUST_MATCH) and not c.startswith(STARTS_ONLY)]
    if fatal:
        keys = [change.split(":")[0] for change in fatal]
        named = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
        raise TrainkitError(
            f"the checkpoint was made with another {named}: use another run_dir, "
            "checkpoint.resume=null, or the settings it was made with",
            details=[f"checkpoint: {state.get('_path', '?')}", *fatal])
    if changes:
        log.warning("resuming with a changed config: %s", "; ".join(changes)[:500])


def weight_differences(here: Mapping[str, Any], saved: Mapping[str, Any]) -> list[str]:
    """How a checkpoint's model weights differ from a model's, one line per name (none: they fit).

    Example:
        >>> weight_differences({"w": torch.zeros(2)}, {"w": torch.zeros(3), "b": torch.zeros(1)})
        ['not in this model: b', 'w: [3] in the checkpoint, [2] here']
    """
    missing = [f"missing in the checkpoint: {name}" for name in here if name not in saved]
    extra = [f"not in this model: {name}" for name in saved if name not in here]
    shapes = [f"{name}: {list(saved[name].shape)} in the checkpoint, {list(t.shape)} here"
              for name, t in here.items() if name in saved and saved[name].shape != t.shape]
    return [*missing, *extra, *shapes]


def check_weights_fit(here: Mapping[str, Any], saved: Mapping[str, Any], *, key: str,
                      path: Any) -> None:
    """Raise a one-line error (the differences as details) unless the checkpoint's weights
    ``saved`` fit a model's ``here`` (both ``{name: anything with .shape}``); ``key`` is the
    setting that named the checkpoint, ``path`` where it is."""
    differences = weight_differences(here, saved)
    if not differences:
        return
    fix = ("use its model config, another run_dir, or checkpoint.resume=null"
           if key == "checkpoint.resume" else "use this model's checkpoint or config")
    groups = {
        "missing in the checkpoint": [name for name in here if name not in saved],
        "extra": [name for name in saved if name not in here],
        "of another shape": [name for name, t in here.items()
                             if name in saved and saved[name].shape != t.shape],
    }
    head = f"{key} does not fit this model: "
    raise TrainkitError(head + _counted_names(groups, LINE_LIMIT - _PREFIX - len(head + fix))
                        + f"; {fix}", details=[f"checkpoint: {path}", *differences])


# Room for what an entry point puts before a message ("trainkit: rank 12: ") and for the longer
# words it may put in it (run_dir -> hydra.run.dir).
_PREFIX = 24


def _counted_names(groups: Mapping[str, list[str]], room: int) -> str:
    """``"4 missing in the checkpoint (a.weight, a.bias, ...), 2 extra (b, c)"``: each
    non-empty group counted, with as many of its first names as fit in ``room`` characters --
    whole names only, never one cut in the middle."""
    counted = {label: names for label, names in groups.items() if names}
    room -= sum(len(f"{len(names)} {label}, (, ...)") for label, names in counted.items())
    parts = []
    for label, names in counted.items():
        shown: list[str] = []
        for name in names:
            if len(name) + 2 > room:
                break
            shown.append(name)
            room -= len(name) + 2
        listing = ", ".join(shown) + (", ..." if len(shown) < len(names) else "")
        parts.append(f"{len(names)} {label}" + (f" ({listing})" if shown else ""))
    return ", ".join(parts)


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``"key: old -> new"`` for every leaf that differs between two nested configs."""
    old, new = flatten(saved), flatten(current)
    return [f"{key}: {old.get(key, '<absent>')} -> {new.get(key, '<absent>')}"
            for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)]


def _git_commit() -> str | None:
    """The working directory's commit (``-dirty`` when it has changes), None outside a repo."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=40"],
                             capture_output=True, text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None
