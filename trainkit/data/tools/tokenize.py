"""Text files to a token corpus in nanoGPT's format: ``train.bin`` and ``val.bin``, flat arrays of
token ids (uint16, or uint32 for vocabularies over 65536), and a ``meta.json`` beside them
(tokenizer, vocabulary size, dtype, token counts) that ``data=tokens`` reads.

    python -m trainkit.data tokenize notes/ more.txt corpus/ --tokenizer bytes

Files are read and written in chunks: a corpus larger than memory is fine. The files' tokens are
concatenated in the order given (a folder's files sorted by path); the last ``--val-fraction`` of
them is ``val.bin``. ``bytes`` is the files' raw bytes (256 tokens, needs nothing); ``gpt2`` is
GPT-2's BPE through tiktoken (``pip install tiktoken``; its encoding files are downloaded once
into tiktoken's cache), with GPT-2's end-of-text token after each file, as nanoGPT does.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from trainkit.core.errors import ConfigError, TrainkitError

CHUNK = 1 << 20  # bytes read (and tokens copied) at a time
TOKENIZERS = ("bytes", "gpt2")


class Tokenizer(Protocol):
    """Text to token ids and back."""

    name: str
    vocab_size: int

    def encode_bytes(self, data: bytes, last: bool) -> list[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Each byte is a token (0-255): any file, no vocabulary to ship."""

    name, vocab_size = "bytes", 256

    def encode_bytes(self, data: bytes, last: bool) -> list[int]:
        return list(data)

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class Gpt2Tokenizer:
    """GPT-2's BPE (tiktoken), with its end-of-text token after each file."""

    name = "gpt2"

    def __init__(self) -> None:
        try:
            import tiktoken
        except ImportError:
            raise ConfigError("--tokenizer gpt2 needs tiktoken: pip install tiktoken "
                              "(or use --tokenizer bytes)") from None
        try:
            self.encoding = tiktoken.get_encoding("gpt2")
        except Exception as err:  # offline: its files are fetched on first use
            raise TrainkitError(
                "tiktoken could not load GPT-2's encoding (offline?): run it once where there is "
                "internet and copy its cache (TIKTOKEN_CACHE_DIR) here",
                details=[f"{type(err).__name__}: {err}"]) from None
        self.vocab_size = self.encoding.n_vocab

    def encode_bytes(self, data: bytes, last: bool) -> list[int]:
        ids = self.encoding.encode_ordinary(data.decode("utf-8", errors="replace"))
        return [*ids, self.encoding.eot_token] if last else ids

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)


def get_tokenizer(name: str) -> Tokenizer:
    """The tokenizer called ``name`` (one of :data:`TOKENIZERS`)."""
    if name == "bytes":
        return ByteTokenizer()
    if name == "gpt2":
        return Gpt2Tokenizer()
    raise ConfigError(f"tokenizer {name!r} is not one of {', '.join(TOKENIZERS)}")


@dataclass
class Corpus:
    """What :func:`tokenize` wrote."""

    train_tokens: int
    val_tokens: int
    files: int


def input_files(inputs: list[Path]) -> list[Path]:
    """The files named, and every file under the folders named (sorted; hidden ones skipped)."""
    files: list[Path] = []
    for path in inputs:
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file()
                            and not any(part.startswith(".") for part in p.relative_to(path).parts))
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"{path} does not exist: give text files or folders of them")
    if not files:
        raise ConfigError(f"no files in {', '.join(map(str, inputs))}")
    return files


def _pieces(path: Path) -> Iterator[tuple[bytes, bool]]:
    """A file's bytes in chunks of about CHUNK, each ending at a line's end; True with the last."""
    with path.open("rb") as f:
        chunk = f.read(CHUNK)
        while chunk:
            chunk += f.readline()  # a BPE merge never spans the cut
            following = f.read(CHUNK)
            yield chunk, not following
            chunk = following


def tokenize(inputs: list[Path], out_dir: Path, tokenizer: str = "bytes",
             val_fraction: float = 0.1, dtype: str = "auto") -> Corpus:
    """Write ``train.bin``, ``val.bin`` and ``meta.json`` for the text in ``inputs`` to ``out_dir``.

    Raises:
        ConfigError: missing inputs, an existing corpus in ``out_dir``, a bad fraction or dtype.
    """
    if not 0 < val_fraction < 1:
        raise ConfigError(f"--val-fraction must be between 0 and 1, got {val_fraction}")
    existing = [n for n in ("train.bin", "val.bin", "meta.json") if (out_dir / n).exists()]
    if existing:
        raise ConfigError(f"{out_dir} already has {', '.join(existing)}: give another output "
                          "folder (nothing was overwritten)")
    files = input_files(inputs)
    tok = get_tokenizer(tokenizer)
    dtype = ("uint16" if tok.vocab_size <= 1 << 16 else "uint32") if dtype == "auto" else dtype
    if dtype not in ("uint16", "uint32") or np.iinfo(dtype).max < tok.vocab_size - 1:
        raise ConfigError(f"--dtype {dtype} cannot hold {tok.vocab_size} token ids: use uint32")
    out_dir.mkdir(parents=True, exist_ok=True)
    whole = out_dir / ".tokens.partial"
    with whole.open("wb") as out:
        for path in files:
            for piece, last in _pieces(path):
                np.asarray(tok.encode_bytes(piece, last), dtype=dtype).tofile(out)
    total = whole.stat().st_size // np.dtype(dtype).itemsize
    n_val = int(total * val_fraction)
    if n_val < 2 or total - n_val < 2:
        whole.unlink()
        raise ConfigError(f"{total} tokens in {len(files)} files are too few to split "
                          f"{val_fraction:g} of them off for validation: give more text")
    _split(whole, out_dir, dtype, total - n_val)
    meta: dict[str, Any] = {"tokenizer": tok.name, "vocab_size": tok.vocab_size, "dtype": dtype,
                            "train_tokens": total - n_val, "val_tokens": n_val,
                            "files": len(files),
                            # what a copy fetched from object storage is checked against
                            "sha256": {name: _sha256(out_dir / name)
                                       for name in ("train.bin", "val.bin")}}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return Corpus(total - n_val, n_val, len(files))


def _split(whole: Path, out_dir: Path, dtype: str, n_train: int) -> None:
    """The first ``n_train`` tokens of ``whole`` to train.bin, the rest to val.bin, in chunks."""
    tokens = np.memmap(whole, dtype=dtype, mode="r")
    for name, part in (("train.bin", tokens[:n_train]), ("val.bin", tokens[n_train:])):
        with (out_dir / name).open("wb") as out:
            for start in range(0, len(part), CHUNK):
                part[start:start + CHUNK].tofile(out)
    del tokens
    os.unlink(whole)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
