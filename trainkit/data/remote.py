"""Data on object storage (``data.root`` an fsspec URL): a local cache in front of the store.

* Whole files (a token corpus's ``train.bin``/``val.bin``, ``meta.json``): :func:`fetch_files`
  downloads each once into ``<cache>/remote/files/`` (``$TRAINKIT_CACHE_DIR``, else
  ``~/.cache/trainkit``), checked by size and checksum (``meta.json``'s SHA-256, else a
  single-part upload's S3 ETag); a later run reuses it while the store reports the same size
  and tag. The caller memory-maps the local copy.
* Folders (an image folder): :func:`fetch_tree` keeps a copy in ``<cache>/remote/folders/``,
  fetching the files missing there or changed in size.
* Shards: :func:`open_shard` streams a shard, keeping a copy in ``<cache>/remote/shards/`` that
  a later epoch reads, within ``data.cache_gb`` (least recently used removed first).

Downloads are renamed into place when finished, so processes sharing the cache (ranks,
DataLoader workers) never see half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from trainkit.core.errors import ConfigError, TrainkitError, one_line
from trainkit.core.objectstore import filesystem, join, store_error
from trainkit.data.tools.checksums import cache_dir

_CHUNK = 1 << 22
# http(s) and pipe: stay webdataset's own (gopen); the other protocols go through fsspec here
WEBDATASET_SCHEMES = ("http://", "https://", "pipe:", "file:")


def _cache(kind: str) -> Path:
    folder = cache_dir() / "remote" / kind
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _info(fs: Any, path: str, url: str, key: str) -> dict[str, Any]:
    try:
        return fs.info(path)
    except FileNotFoundError:
        raise ConfigError(f"{url} does not exist: check {key}") from None
    except Exception as err:
        raise (store_error(err, url, key)
               or TrainkitError(f"cannot read {url} ({one_line(err, 80)})")) from None


def _tag(info: dict[str, Any]) -> str:
    """What says the object changed: its ETag (S3), md5Hash (GCS), etag (Azure), else mtime."""
    for name in ("ETag", "md5Hash", "etag", "mtime", "LastModified"):
        if info.get(name):
            return str(info[name])
    return ""


def first_contact(root: str, key: str = "data.root") -> None:
    """Fail in seconds, not after the packages' retries, when the store cannot be reached: one
    brief request (a missing path is left to the reader, which names what is missing)."""
    fs, base = filesystem(root, key, quick=True)
    try:
        fs.info(base)
    except FileNotFoundError:
        pass
    except Exception as err:
        raise (store_error(err, root, key)
               or ConfigError(f"cannot read {root} ({one_line(err, 80)})")) from None


def fetch_files(root: str, names: Sequence[str], optional: Sequence[str] = (), *,
                key: str = "data.root") -> Path:
    """The local folder holding the files ``names`` (and those of ``optional`` that exist) of
    the URL ``root``, each fetched once and verified. ``meta.json``, when among them, is read
    first: its ``sha256`` (name -> hex digest) is what the others are checked against.

    Raises:
        ConfigError: the store cannot be reached, a file is missing, or a download does not
            match its size or checksum.
    """
    first_contact(root, key)
    fs, base = filesystem(root, key)
    folder = _cache("files") / hashlib.sha1(root.rstrip("/").encode()).hexdigest()[:16]
    folder.mkdir(exist_ok=True)
    sums: dict[str, str] = {}
    for name in [*optional, *names]:
        path, url = join(base, name), join(root, name)
        if name in optional:
            try:
                if not fs.exists(path):
                    continue
            except Exception as err:
                raise (store_error(err, url, key) or ConfigError(
                    f"cannot read {url} ({one_line(err, 80)})")) from None
        _fetch(fs, path, url, folder / name, sums.get(name), key)
        if name == "meta.json":
            sums = json.loads((folder / name).read_text()).get("sha256") or {}
    return folder


def _fetch(fs: Any, path: str, url: str, local: Path, sha256: str | None, key: str) -> None:
    """Download ``url`` to ``local`` unless the copy there is of the store's version."""
    info = _info(fs, path, url, key)
    size, tag = int(info.get("size") or 0), _tag(info)
    record = local.with_name(f".{local.name}.json")
    wanted = {"url": url, "size": size, "tag": tag}
    try:
        if (local.stat().st_size == size and json.loads(record.read_text())["source"] == wanted
                and sha256 in (None, json.loads(record.read_text())["sha256"])):
            return
    except (OSError, ValueError, KeyError):
        pass
    tmp = local.with_name(f".{local.name}.{uuid.uuid4().hex[:8]}.tmp")
    digests = {"sha256": hashlib.sha256(), "md5": hashlib.md5()}
    try:
        with fs.open(path, "rb") as src, open(tmp, "wb") as out:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                for digest in digests.values():
                    digest.update(chunk)
        got = {name: digest.hexdigest() for name, digest in digests.items()}
        _verify(url, tmp.stat().st_size, size, got, sha256, tag)
        record.write_text(json.dumps({"source": wanted, "sha256": got["sha256"]}))
        os.replace(tmp, local)
    except Exception as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, TrainkitError):
            raise
        raise (store_error(err, url, key)
               or ConfigError(f"cannot fetch {url} ({one_line(err, 80)})")) from None


def _verify(url: str, got_size: int, size: int, got: dict[str, str], sha256: str | None,
            tag: str) -> None:
    """Raise unless the download has the store's size and its checksum."""
    etag = tag.strip('"')
    if got_size != size:
        problem = f"{got_size} bytes arrived of {size}"
    elif sha256 is not None and got["sha256"] != sha256:
        problem = "its SHA-256 differs from meta.json's"
    elif sha256 is None and len(etag) == 32 and "-" not in etag and got["md5"] != etag:
        problem = "its MD5 differs from the store's ETag"
    else:
        return
    raise ConfigError(f"the download of {url} is corrupt ({problem}): run again; if it "
                      "persists, check the file in the store")


def fetch_tree(root: str, *, key: str = "data.root") -> Path:
    """A local copy of the folder at the URL ``root`` (an image folder), in the cache: files
    missing there or of another size than the store's are fetched (concurrently), files no
    longer in the store removed. Returns the copy's folder.

    Raises:
        ConfigError: the store cannot be reached, or ``root`` holds no files.
    """
    first_contact(root, key)
    fs, base = filesystem(root, key)
    folder = _cache("folders") / hashlib.sha1(root.rstrip("/").encode()).hexdigest()[:16]
    try:
        found = {path[len(base):].lstrip("/"): info
                 for path, info in fs.find(base, detail=True).items()}
    except Exception as err:
        raise (store_error(err, root, key)
               or ConfigError(f"cannot list {root} ({one_line(err, 80)})")) from None
    if not found:
        raise ConfigError(f"{key}={root} holds no files: point it at a folder of train/<class>/ "
                          "(and val/<class>/) image folders")
    for path in folder.rglob("*") if folder.is_dir() else ():
        if path.is_file() and path.relative_to(folder).as_posix() not in found:
            path.unlink()
    wanted = [name for name, info in found.items()
              if not ((folder / name).is_file()
                      and (folder / name).stat().st_size == int(info.get("size") or 0))]
    tmps = [folder / f"{name}.{uuid.uuid4().hex[:8]}.tmp" for name in wanted]
    for tmp in tmps:
        tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        if wanted:
            fs.get([join(base, name) for name in wanted], [str(tmp) for tmp in tmps])
        for name, tmp in zip(wanted, tmps):
            if tmp.stat().st_size != int(found[name].get("size") or 0):
                raise ConfigError(f"the download of {join(root, name)} is corrupt (of another "
                                  "size than the store's): run again")
            os.replace(tmp, folder / name)
    finally:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)
    return folder


def is_store_url(location: str) -> bool:
    """Whether a shard location is read through fsspec here (not by webdataset's gopen)."""
    from trainkit.core.location import on_store

    return on_store(location) and not location.startswith(WEBDATASET_SCHEMES)


def open_shard(url: str, cache_bytes: int) -> IO[bytes]:
    """A stream of the shard at ``url``: its cached copy, or the store's bytes (a copy kept as
    they are read, when ``cache_bytes`` > 0)."""
    fs, path = filesystem(url, "data.shards")
    info = _info(fs, path, url, "data.shards")
    name = hashlib.sha1(f"{url}|{info.get('size')}|{_tag(info)}".encode()).hexdigest()[:24]
    local = _cache("shards") / f"{name}.tar"
    if cache_bytes > 0 and local.is_file():
        os.utime(local)  # recently used
        return open(local, "rb")
    src = fs.open(path, "rb", block_size=_CHUNK)
    if cache_bytes <= 0:
        return src
    return _KeptCopy(src, local, int(info.get("size") or 0), cache_bytes)


class _KeptCopy:
    """Reads from ``src``, writing what it reads to a temporary file that becomes ``local``
    once all ``size`` bytes are read (a tar reader may stop before the archive's padding: the
    rest is read then); then the cache is cut back to ``cache_bytes``."""

    def __init__(self, src: IO[bytes], local: Path, size: int, cache_bytes: int) -> None:
        self.src, self.local, self.size, self.cache_bytes = src, local, size, cache_bytes
        self.tmp = local.with_name(f".{local.name}.{uuid.uuid4().hex[:8]}.tmp")
        self.out: IO[bytes] | None = open(self.tmp, "wb")  # noqa: SIM115 (closed at the end)
        self.copied = 0

    def read(self, size: int = -1) -> bytes:
        data = self.src.read(size)
        if self.out is not None:
            self.out.write(data)
            self.copied += len(data)
            if not data or self.copied >= self.size:  # the end: the copy is whole
                self.out.close()
                self.out = None
                os.replace(self.tmp, self.local)
                _trim(self.local.parent, self.cache_bytes, keep=self.local)
        return data

    def close(self) -> None:
        self.src.close()
        if self.out is not None:  # not read to its end: no copy
            self.out.close()
            self.tmp.unlink(missing_ok=True)
            self.out = None

    def __enter__(self) -> _KeptCopy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _trim(folder: Path, budget: int, keep: Path) -> None:
    """Remove the least recently used shard copies until the rest fit in ``budget`` bytes."""
    copies = []
    for path in folder.glob("*.tar"):
        try:
            stat = path.stat()
        except OSError:  # another worker removed it meanwhile
            continue
        copies.append((stat.st_mtime, stat.st_size, path))
    total = sum(size for _, size, _ in copies)
    for _, size, path in sorted(copies):
        if total <= budget:
            break
        if path != keep:
            path.unlink(missing_ok=True)  # a reader that has it open reads on
            total -= size
