"""md5 checks remembered per file version (trainkit.data.tools.checksums)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from trainkit.core.errors import TrainkitError
from trainkit.data.tools.checksums import cache_dir, check_md5


def _file(tmp_path: Path, content: bytes = b"official contents") -> tuple[Path, str]:
    path = tmp_path / "data.bin"
    path.write_bytes(content)
    return path, hashlib.md5(content).hexdigest()


def _tamper_keeping_stamp(path: Path) -> None:
    """Change the bytes but not the size or modification time: only hashing can tell."""
    info = path.stat()
    content = path.read_bytes()
    path.write_bytes(bytes([content[0] ^ 1]) + content[1:])
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))


def test_a_verified_file_is_not_hashed_again_until_it_changes(tmp_path: Path) -> None:
    path, md5 = _file(tmp_path)
    check_md5(path, md5)  # hashed, matched, recorded
    assert (cache_dir() / "verified.json").is_file()
    _tamper_keeping_stamp(path)
    check_md5(path, md5)  # same size and mtime: accepted from the record, not hashed
    with pytest.raises(TrainkitError, match="md5 mismatch"):
        check_md5(path, md5, remembered=False)  # `trainkit data verify` always hashes
    path.write_bytes(path.read_bytes())  # rewritten: a new mtime, so hashed again
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    with pytest.raises(TrainkitError, match="md5 mismatch"):
        check_md5(path, md5)


def test_a_mismatch_is_never_recorded(tmp_path: Path) -> None:
    path, _ = _file(tmp_path)
    for _ in range(2):  # the second check hashes again and fails again
        with pytest.raises(TrainkitError, match="not the official file"):
            check_md5(path, "0" * 32)


def test_checks_run_without_a_usable_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           ) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder would go")
    monkeypatch.setenv("TRAINKIT_CACHE_DIR", str(blocker / "cache"))
    path, md5 = _file(tmp_path)
    check_md5(path, md5)  # nothing can be recorded: no error
    _tamper_keeping_stamp(path)
    with pytest.raises(TrainkitError, match="md5 mismatch"):  # so it hashes every time
        check_md5(path, md5)


def test_a_corrupt_record_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINKIT_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    record = tmp_path / "cache" / "verified.json"
    record.write_text('{"half-written')  # a crash mid-write, before atomic replaces
    path, md5 = _file(tmp_path)
    check_md5(path, md5)  # the half-written record is read as empty: the file is hashed
    info = path.stat()
    # rewritten whole, with this file in it: its size, mtime and md5
    assert json.loads(record.read_text()) == {
        str(path.resolve()): [info.st_size, info.st_mtime_ns, md5]}
    assert not list(record.parent.glob(".verified.*.tmp"))  # no temporary file left
    _tamper_keeping_stamp(path)
    check_md5(path, md5)  # accepted from the new record, not hashed: the record is used
