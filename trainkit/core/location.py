"""Where a setting points: a local path or an object store's URL, decided here once.

``checkpoint.dir``, ``checkpoint.resume``/``init_from`` and ``data.root`` may each name a folder
on a disk or any fsspec URL (``s3://``, ``gs://``, ``memory://``, ...). This is the one module
that tells the two apart; the rest of trainkit takes what it returns: a URL as a string (read
through :mod:`~trainkit.core.objectstore`), a path as a :class:`~pathlib.Path`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from trainkit.core.objectstore import join

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
RUN_CONFIG = Path(".hydra") / "config.yaml"  # the entry point's record of a run's settings


def is_url(location: object) -> bool:
    """Whether ``location`` is a URL with a protocol (a string; a Path never is)."""
    return isinstance(location, str) and bool(_URL.match(location))


def on_store(location: object) -> bool:
    """Whether ``location`` lies on an object store (an fsspec URL), not on a disk."""
    return is_url(location)


def locate(name: str | Path) -> Path | str:
    """``name`` as trainkit takes a location: a URL as a string without a slash at its end, a
    path as a Path (``~`` expanded)."""
    return str(name).rstrip("/") if is_url(name) else Path(name).expanduser()


def fetched(name: str | Path, fetch: Callable[[str], Path]) -> Path:
    """A local folder for ``name``: the path itself, or ``fetch(url)`` (a local copy) for a URL."""
    return fetch(str(name)) if is_url(name) else Path(name).expanduser()


def child(root: str | Path, name: str) -> str:
    """``root/name`` spelled as ``root`` is: a URL's child as a URL, a path's as a path."""
    return join(str(root), name) if is_url(root) else str(Path(root) / name)


def recorded_dir(run_dir: Path) -> str | None:
    """``checkpoint.dir`` as the run's ``.hydra/config.yaml`` records it (resolved): where the
    run put its checkpoints (a folder or a store's URL); None where it is unset, not recorded or
    does not resolve outside the run (its checkpoints are then in ``<run_dir>/checkpoints``)."""
    file = run_dir / RUN_CONFIG
    if not file.is_file():
        return None
    from omegaconf import OmegaConf

    try:
        value = OmegaConf.select(OmegaConf.load(file), "checkpoint.dir", default=None,
                                 throw_on_resolution_failure=False)
    except Exception:  # an unreadable record: the run's own folder is looked in
        return None
    return str(value) if value not in (None, "") else None
