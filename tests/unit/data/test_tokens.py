"""data=tokens: windows of a memory-mapped token file, their order and resume; the tokenizer
that writes such files (python -m trainkit.data tokenize)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from trainkit.core.errors import ConfigError
from trainkit.data.__main__ import main as data_main
from trainkit.data.loader.tokens import TokenLoader
from trainkit.data.tools.tokenize import tokenize


def token_file(path: Path, n: int, dtype: str = "uint16") -> np.ndarray:
    """A file of token ids ``i * 7 % 65521``: every window tells where it was read from."""
    tokens = (np.arange(n, dtype=np.int64) * 7 % 65521).astype(dtype)
    tokens.tofile(path)
    return tokens


def batches(loader: TokenLoader) -> list[torch.Tensor]:
    return [batch["tokens"] for batch in loader]


def test_training_windows_are_slices_of_the_file_fixed_by_seed_epoch_rank_and_batch(
        tmp_path: Path) -> None:
    file = tmp_path / "train.bin"
    tokens = token_file(file, 5000)
    loader = TokenLoader(file, seq_len=16, batch_size=4, shuffle=True, seed=3, rank=1,
                         world_size=2)
    assert len(loader) == (5000 - 1) // 16 // (2 * 4)
    epoch0 = batches(loader)
    assert len(epoch0) == len(loader)
    for batch in epoch0:
        assert batch.dtype == torch.int64 and batch.shape == (4, 17)
        for row in batch.numpy():  # a contiguous window of the file, wherever it starts
            start = int(np.flatnonzero(tokens == row[0])[0])
            assert np.array_equal(row, tokens[start:start + 17])
    again = TokenLoader(file, seq_len=16, batch_size=4, shuffle=True, seed=3, rank=1,
                        world_size=2)
    assert all(torch.equal(a, b) for a, b in zip(epoch0, batches(again)))
    rank0 = TokenLoader(file, seq_len=16, batch_size=4, shuffle=True, seed=3, rank=0,
                        world_size=2)
    assert not torch.equal(batches(rank0)[0], epoch0[0])
    loader.set_epoch(1)
    assert not torch.equal(batches(loader)[0], epoch0[0])


def test_resume_mid_epoch_reads_the_batches_an_uninterrupted_pass_reads(tmp_path: Path) -> None:
    file = tmp_path / "train.bin"
    token_file(file, 3000, "uint32")
    loader = TokenLoader(file, seq_len=8, batch_size=3, shuffle=True, dtype="uint32", seed=1)
    loader.set_epoch(2)
    whole = batches(loader)
    loader.set_epoch(2)
    for _ in zip(range(5), loader):  # five batches handed out, then "preempted"
        pass
    resumed = TokenLoader(file, seq_len=8, batch_size=3, shuffle=True, dtype="uint32", seed=1)
    resumed.load_state_dict(loader.state_dict())
    resumed.set_epoch(2, 5)  # the caller's position: five batches of epoch 2 handed out
    rest = batches(resumed)
    assert len(rest) == len(whole) - 5
    assert all(torch.equal(a, b) for a, b in zip(whole[5:], rest))
    assert len(batches(resumed)) == len(whole)  # the offset applies to one pass only


def test_evaluation_reads_the_file_end_to_end_split_between_ranks_in_order(
        tmp_path: Path) -> None:
    file = tmp_path / "val.bin"
    tokens = token_file(file, 16 * 11 + 1)  # 11 windows of 16 (+1)
    per_rank = [torch.cat(batches(TokenLoader(file, seq_len=16, batch_size=4, shuffle=False,
                                              rank=r, world_size=2))) for r in (0, 1)]
    assert [len(w) for w in per_rank] == [6, 5]  # the last batch of each is short
    windows = [per_rank[i % 2][i // 2] for i in range(11)]
    for i, window in enumerate(windows):
        assert np.array_equal(window.numpy(), tokens[16 * i:16 * i + 17])


def test_bad_token_files_are_one_line_each(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist: write it with"):
        TokenLoader(tmp_path / "nope.bin", 8, 2, shuffle=True)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"abc")
    with pytest.raises(ConfigError, match="not a whole number of uint16 tokens"):
        TokenLoader(odd, 8, 2, shuffle=True)
    small = tmp_path / "small.bin"
    token_file(small, 40)
    with pytest.raises(ConfigError, match="not one batch of 8 windows of 9"):
        TokenLoader(small, 8, 8, shuffle=True)


def test_tokenize_bytes_writes_the_files_bytes_split_at_the_val_fraction(tmp_path: Path) -> None:
    text = tmp_path / "text"
    (text / "sub").mkdir(parents=True)
    (text / "b.txt").write_bytes(b"second file\n" * 50)
    (text / "a.txt").write_bytes("first file \u00e9\n".encode() * 40)
    (text / "sub" / "c.txt").write_bytes(bytes(range(256)))
    (text / ".hidden").write_bytes(b"skipped")
    out = tmp_path / "corpus"
    corpus = tokenize([text], out, "bytes", val_fraction=0.25)
    expected = b"".join((text / n).read_bytes() for n in ("a.txt", "b.txt", "sub/c.txt"))
    train, val = (np.fromfile(out / n, dtype=np.uint16) for n in ("train.bin", "val.bin"))
    assert bytes(np.concatenate([train, val]).astype(np.uint8)) == expected
    assert len(val) == int(len(expected) * 0.25) == corpus.val_tokens
    meta = json.loads((out / "meta.json").read_text())
    sums = {name: hashlib.sha256((out / name).read_bytes()).hexdigest()
            for name in ("train.bin", "val.bin")}  # what a copy from a bucket is checked by
    assert meta == {"tokenizer": "bytes", "vocab_size": 256, "dtype": "uint16", "files": 3,
                    "train_tokens": len(train), "val_tokens": len(val), "sha256": sums}
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_tokenize_command_refuses_to_overwrite_and_missing_input(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("some words to learn from\n" * 20)
    out = tmp_path / "corpus"
    assert data_main(["tokenize", str(text), str(out)]) == 0
    assert f"train with +exp=lm data.root={out}" in capsys.readouterr().out
    before = (out / "train.bin").read_bytes()
    assert data_main(["tokenize", str(text), str(out)]) == 2
    assert "already has train.bin, val.bin, meta.json" in capsys.readouterr().err
    assert (out / "train.bin").read_bytes() == before
    assert data_main(["tokenize", str(tmp_path / "missing"), str(tmp_path / "o2")]) == 2
    assert "missing does not exist" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()
