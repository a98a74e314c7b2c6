"""md5 checks of dataset files, remembered per file version so that a run checks once.

Hashing a dataset's files costs time every run paid again for files that had not changed.
A file whose md5 matched is recorded with its size and modification time in
``<cache>/verified.json`` (``$TRAINKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/trainkit``, else
``~/.cache/trainkit``); while both stay the same, the next run accepts it without hashing.
A rewritten or replaced file is hashed again. ``python -m trainkit.data verify`` always hashes.
Where the cache cannot be written the check simply runs every time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path

from trainkit.core.errors import TrainkitError

_RECORD = "verified.json"


def check_md5(path: Path, expected: str, data: bytes | bytearray | None = None, *,
              remembered: bool = True) -> None:
    """Raise a one-line :class:`TrainkitError` unless ``path``'s md5 (of ``data``, its contents
    when already read) is ``expected``.

    With ``remembered``, a file recorded as matching ``expected`` at its present size and
    modification time is accepted without hashing, and a match is recorded.
    """
    stamp = _stamp(path, expected)
    if remembered and _records().get(stamp[0]) == stamp[1]:
        return
    data = path.read_bytes() if data is None else data
    digest = hashlib.md5(data, usedforsecurity=False).hexdigest()
    if digest != expected:
        raise TrainkitError(
            f"{path.name} is corrupt or not the official file (md5 mismatch): re-download it, or "
            "set data.verify=false to load it anyway",
            details=[f"{path} has md5 {digest}, not the official {expected}"])
    if remembered:
        _remember(*stamp)


def cache_dir() -> Path:
    """Where trainkit keeps what it remembers between runs (the verified files)."""
    if os.environ.get("TRAINKIT_CACHE_DIR"):
        return Path(os.environ["TRAINKIT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "trainkit"


def _stamp(path: Path, expected: str) -> tuple[str, list[object]]:
    """The record's key and value for ``path`` as it is now."""
    info = path.stat()
    return str(path.resolve()), [info.st_size, info.st_mtime_ns, expected]


def _records() -> dict[str, list[object]]:
    try:
        records = json.loads((cache_dir() / _RECORD).read_text())
    except (OSError, ValueError):  # none yet, unreadable or half-written by a crash: start over
        return {}
    return records if isinstance(records, dict) else {}


def _remember(key: str, value: list[object]) -> None:
    """Add one record, replacing the file atomically (several ranks may write at once)."""
    records = {**_records(), key: value}
    folder = cache_dir()
    with contextlib.suppress(OSError):  # read-only home, full disk: the check just runs again
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".verified.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as file:
                json.dump(records, file)
            os.replace(tmp, folder / _RECORD)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
