"""data.mix: corpora mixed by weight per sample, the same at any number of workers, resumable
mid-epoch, each rank its share of one stream, each corpus evaluated apart; bad entries refused
in one line."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from trainkit.config import DataConfig
from trainkit.core.errors import ConfigError
from trainkit.core.runtime import Runtime
from trainkit.data import load_data
from trainkit.data.loader.mixture import (
    EachSource,
    MixedTokenLoader,
    MixtureSampler,
    apportion,
    mixture_order,
)
from trainkit.data.pipeline import loader_of
from trainkit.data.sources.source import MapStyle, Mixture, Options
from trainkit.loop.evaluation import evaluate
from trainkit.loop.precision import Precision
from trainkit.loop.step import default_forward

CPU = Runtime(torch.device("cpu"))


def corpus(folder: Path, n: int, first: int) -> Path:
    """A token corpus whose every token is ``first`` or more (train.bin, val.bin, meta.json):
    a window tells which corpus it was read from."""
    folder.mkdir(parents=True)
    for split, size in (("train", n), ("val", n // 4)):
        (first + np.arange(size) % 100).astype(np.uint16).tofile(folder / f"{split}.bin")
    (folder / "meta.json").write_text('{"vocab_size": 512, "dtype": "uint16"}')
    return folder


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("mix")
    return corpus(tmp / "web", 20_000, 0), corpus(tmp / "code", 5_000, 200)


def mix_config(corpora: tuple[Path, Path], **extra: object) -> DataConfig:
    web, code = corpora
    return DataConfig(name="tokens", seq_len=16, batch_size=100, eval_batch_size=8,
                      mix=[{"root": str(web), "weight": 3}, {"root": str(code), "weight": 1}],
                      **extra)


def test_two_token_corpora_at_three_to_one_give_75_percent_of_10k_windows(
        corpora: tuple[Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="trainkit"):
        train, val, vocab = load_data(mix_config(corpora), CPU, seed=5)
    assert isinstance(train, MixedTokenLoader) and vocab == 512
    epochs = (batch["tokens"] for epoch in range(7) for batch in train.batches(epoch))
    windows = torch.cat([tokens for tokens, _ in zip(epochs, range(100))])  # 15 an epoch
    assert windows.shape == (10_000, 17)
    first = (windows < 200).all(1)
    assert (first | (windows >= 200).all(1)).all()  # each window from one corpus
    assert abs(first.float().mean().item() - 0.75) <= 0.02
    # the line that states the mixture: weights and sizes
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("data.mix"))
    assert line == ("data.mix: web weight 0.75 (20,000 tokens, 1,249 windows of 16), "
                    "code weight 0.25 (5,000 tokens, 312 windows of 16)")
    assert isinstance(val, EachSource) and list(val.parts) == ["web", "code"]


def test_a_map_style_mixture_at_three_to_one_gives_75_percent_of_10k_samples() -> None:
    sizes = [3_000, 7_000]  # the first corpus is the smaller: its samples come up again
    stream = mixture_order(sizes, [0.75, 0.25], seed=1, epoch=0)
    assert len(stream) == 10_000
    first = stream < 3_000
    assert abs(first.float().mean().item() - 0.75) <= 0.02
    assert torch.bincount(stream[first]).min() >= 2  # every sample of it, 2 or 3 times
    assert len(set(stream[~first].tolist())) == 2_500  # 2,500 of the other's, none twice
    assert not torch.equal(stream, mixture_order(sizes, [0.75, 0.25], seed=1, epoch=1))
    assert apportion([0.75, 0.25], 10_000) == [7_500, 2_500]
    assert apportion([1, 1, 1], 10) == [4, 3, 3]


def map_style_mixture(num_workers: int, batch_size: int = 8, *, shuffle: bool = True,
                      runtime: Runtime = CPU) -> object:
    """Two TensorDataset corpora (values 0-99 and 1000-1039) mixed 1:2 through the pipeline."""
    parts = tuple(MapStyle(TensorDataset(torch.arange(start, start + n)), batch_size,
                           shuffle=shuffle, num_workers=num_workers, normalize_float=False)
                  for start, n in ((0, 100), (1000, 40)))
    return loader_of(Mixture(("a", "b"), parts, (1 / 3, 2 / 3)), runtime, Options(seed=7))


def values(loader: object, epoch: int, start: int = 0) -> list[list[int]]:
    return [batch[0].tolist() for batch in loader.batches(epoch, start)]  # type: ignore[attr-defined]


def test_the_same_mixture_at_one_and_two_workers_gives_the_same_batches() -> None:
    at = {workers: values(map_style_mixture(workers), 1) for workers in (0, 1, 2)}
    assert at[0] == at[1] == at[2]
    flat = [v for batch in at[0] for v in batch]
    assert len(flat) == 140 and sum(v >= 1000 for v in flat) == round(140 * 2 / 3)


def test_a_mid_epoch_resume_continues_the_mixture_exactly(corpora: tuple[Path, Path]) -> None:
    loader = map_style_mixture(2)
    whole = values(loader, 3)
    assert values(loader, 3, start=5) == whole[5:]
    tokens, _, _ = load_data(mix_config(corpora), CPU, seed=5)
    whole_tokens = [b["tokens"] for b in tokens.batches(2)]
    resumed = [b["tokens"] for b in tokens.batches(2, 4)]
    assert len(resumed) == len(whole_tokens) - 4
    assert all(torch.equal(a, b) for a, b in zip(resumed, whole_tokens[4:]))
    assert len(whole_tokens) == len(tokens) == (1_249 + 312) // 100


def test_each_rank_takes_its_share_of_the_one_mixed_stream() -> None:
    sampler = {r: MixtureSampler([100, 40], [1 / 3, 2 / 3], 10, seed=7, rank=r, world_size=2)
               for r in (0, 1)}
    single = MixtureSampler([100, 40], [1 / 3, 2 / 3], 10, seed=7)
    stream = [i for batch in single for i in batch.indices]
    shards = {r: [i for batch in sampler[r] for i in batch.indices] for r in (0, 1)}
    assert shards[0] == stream[0::2] and shards[1] == stream[1::2]


def test_each_corpus_is_evaluated_apart() -> None:
    class Constant(torch.nn.Module):  # logits favouring class 0: a known loss per target
        def __init__(self) -> None:
            super().__init__()
            self.bias = torch.nn.Parameter(torch.tensor([2.0, 0.0]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bias.expand(len(x), 2)

    zeros = [(torch.zeros(4, 1), torch.zeros(4, dtype=torch.long))] * 3  # 12 samples of class 0
    ones = [(torch.zeros(4, 1), torch.ones(4, dtype=torch.long))]  # 4 samples of class 1
    results = evaluate(Constant(), EachSource({"a": zeros, "b": ones}),
                       precision=Precision("32", torch.device("cpu")),
                       device=torch.device("cpu"), criterion=torch.nn.CrossEntropyLoss(),
                       metrics=None, forward=default_forward)
    loss_a = torch.nn.functional.cross_entropy(torch.tensor([[2.0, 0.0]]), torch.tensor([0]))
    loss_b = torch.nn.functional.cross_entropy(torch.tensor([[2.0, 0.0]]), torch.tensor([1]))
    assert results["val/loss/a"] == pytest.approx(loss_a.item())
    assert results["val/loss/b"] == pytest.approx(loss_b.item())
    assert results["val/loss"] == pytest.approx((12 * loss_a.item() + 4 * loss_b.item()) / 16)


@pytest.mark.parametrize(("mix", "line"), [
    ([], r"^data.mix must be a non-empty list"),
    ([{"root": "a", "weight": 0}], r"^data.mix\[0\].weight must be a number > 0, got 0$"),
    ([{"root": "a", "weight": -1.5}], r"weight must be a number > 0, got -1.5$"),
    ([{"root": "a"}], r"weight must be a number > 0, got None$"),
    ([{"weight": 1}], r"^data.mix\[0\] needs a root"),
    ([{"root": "a", "weight": 1, "wieght": 2}], r"^data.mix\[0\].wieght is not read: an "
                                                 r"entry takes root, weight, name, source$"),
])
def test_a_bad_mixture_is_one_line(mix: list, line: str) -> None:
    with pytest.raises(ConfigError, match=line):
        DataConfig(name="tokens", mix=mix)


def test_a_mixture_of_kinds_or_of_one_name_twice_is_refused(corpora: tuple[Path, Path]) -> None:
    web, code = corpora
    cases = {
        "hf_text": r"^data.mix\[1\].source=hf_text cannot share a batch with data=tokens",
        None: r"^data.mix: two entries are named 'web': give each a name$",
    }
    for kind, line in cases.items():
        second = {"root": str(web), "weight": 1}
        if kind:
            second = {"root": str(code), "weight": 1, "source": kind}
        cfg = DataConfig(name="tokens", seq_len=16, mix=[{"root": str(web), "weight": 1},
                                                          second])
        with pytest.raises(ConfigError, match=line):
            load_data(cfg, CPU)
    with pytest.raises(ConfigError, match=r"^data.mix=.* is not read by data=mnist"):
        load_data(DataConfig(name="mnist", mix=[{"root": str(web), "weight": 1}]), CPU)


def test_two_text_corpora_mix_through_hf_text_the_same_at_any_workers(
        tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    from tests.helpers.causal_lm import write_tokenizer

    write_tokenizer(tmp_path / "tok", vocab_size=300)
    roots = []
    for name, texts in (("short", [f"a{i}" for i in range(60)]),
                        ("long", [f"b{i} " * 8 for i in range(30)])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.txt").write_text("\n".join(texts) + "\n")
        (tmp_path / name / "test.txt").write_text("\n".join(texts[:8]) + "\n")
        roots.append(str(tmp_path / name))

    def loaders(workers: int) -> tuple[object, object]:
        cfg = DataConfig(name="hf_text", tokenizer=str(tmp_path / "tok"), batch_size=6,
                         eval_batch_size=4, seq_len=32, num_workers=workers,
                         mix=[{"root": roots[0], "weight": 1}, {"root": roots[1], "weight": 1}])
        train, val, _ = load_data(cfg, CPU, seed=2)
        return train, val

    (train, val), (two, _) = loaders(0), loaders(2)
    batches = list(train.batches(1))
    assert len(batches) == 90 // 6 and all(
        torch.equal(a["input_ids"], b["input_ids"])
        for a, b in zip(batches, two.batches(1), strict=True))
    lengths = torch.cat([batch["attention_mask"].sum(1) for batch in batches])
    assert len(lengths) == 90 and (lengths > 8).sum() == 45  # each corpus half the stream
    assert list(val.parts) == ["short", "long"] and len(val) == 2 + 2
