"""``data.pack=true`` (trainkit.data.sources.packing): the windows, their batches, and no
attention across documents in tiny random-weight GPT-2 and Llama models made here (sdpa)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from trainkit.core.errors import ConfigError
from trainkit.data.sources.packing import (
    IGNORE,
    PackBatch,
    PackedWindows,
    best_fit,
    real_tokens,
)
from trainkit.models.hf import check_packing, hf_forward

transformers = pytest.importorskip("transformers")
VOCAB = 97


def tiny(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2,
                                         n_head=2, bos_token_id=0, eos_token_id=0,
                                         attn_implementation="sdpa")
        model = transformers.GPT2LMHeadModel(config).eval()
        model.loss_type = "ForCausalLM"
        return model
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).eval()
    model.loss_type = "ForCausalLM"
    return model


class Tokens:
    """A tokenizer of space-separated integers (what PackedWindows calls), end-of-text 0."""

    eos_token_id = 0

    def __call__(self, texts: list[str], *, truncation: bool, max_length: int
                 ) -> dict[str, Any]:
        return {"input_ids": [[int(w) for w in t.split()][:max_length] for t in texts]}


def test_best_fit_places_each_document_once_within_the_capacity() -> None:
    lengths = [7, 3, 9, 1, 5, 5, 2, 8, 4, 6]
    bins = best_fit(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == -(-sum(lengths) // 10)  # this set packs with no bin to spare
    assert best_fit(lengths, 10) == bins  # deterministic: the same split, the same windows
    with pytest.raises(ValueError):
        best_fit([11], 10)


def test_windows_restart_positions_end_documents_and_label_no_boundary() -> None:
    texts = ["5 6 7", "8 9", "10 11 12 13 14 15 16 17 18 19 20", "21"]
    windows = PackedWindows(texts, Tokens(), seq_len=8)
    # each text cut to 7 tokens plus the end-of-text token
    assert windows.real_tokens() == 4 + 3 + 8 + 2
    seen = []
    for i in range(len(windows)):
        w = windows[i]
        assert len(w["input_ids"]) <= 8
        starts = (w["position_ids"] == 0).nonzero().flatten().tolist()
        assert w["labels"][starts].eq(IGNORE).all()  # no loss across a boundary
        ends = [s - 1 for s in starts[1:]] + [len(w["input_ids"]) - 1]
        assert w["input_ids"][ends].eq(0).all()  # an end-of-text token ends each document
        keep = w["labels"] != IGNORE
        assert torch.equal(w["labels"][keep], w["input_ids"][keep])
        seen += [w["input_ids"][a:b + 1].tolist() for a, b in zip(starts, ends)]
    assert sorted(seen) == sorted([[5, 6, 7, 0], [8, 9, 0], [10, 11, 12, 13, 14, 15, 16, 0],
                                   [21, 0]])
    batch = PackBatch(pad=0)([windows[i] for i in range(len(windows))])
    assert set(batch) == {"input_ids", "position_ids", "labels"}  # no mask: positions say
    # the padding continues its row's last positions, predicts nothing, counts as no token
    assert int(real_tokens(batch)) == windows.real_tokens()
    diff = batch["position_ids"].diff(dim=1)
    assert ((diff == 1) | (batch["position_ids"][:, 1:] == 0)).all()


def packed(docs: list[list[int]], pad_to: int) -> dict[str, torch.Tensor]:
    ids = [t for d in docs for t in d]
    positions = [p for d in docs for p in range(len(d))]
    labels = list(ids)
    at = 0
    for d in docs:
        labels[at] = IGNORE
        at += len(d)
    n = len(ids)
    return PackBatch(pad=0)([{"input_ids": torch.tensor(ids), "labels": torch.tensor(labels),
                              "position_ids": torch.tensor(positions)},
                             {"input_ids": torch.tensor(ids[:n // 2] + [1] * (pad_to - n // 2)),
                              "labels": torch.tensor(labels[:n // 2] + [1] * (pad_to - n // 2)),
                              "position_ids": torch.arange(pad_to)}])


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_document_is_not_attended_from_the_next(name: str) -> None:
    model = tiny(name)
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (9, 6, 11))
    other_a = torch.randint(1, VOCAB, (9,), generator=g).tolist()
    with torch.no_grad():
        one = hf_forward(model, packed([a, b, c], 30))[0].view(2, 29, VOCAB)[0]
        two = hf_forward(model, packed([other_a, b, c], 30))[0].view(2, 29, VOCAB)[0]
        alone = model(input_ids=torch.tensor([b + c]),
                      position_ids=torch.tensor([list(range(6)) + list(range(11))]),
                      use_cache=False).logits[0]
        # the control: the same window read as one text attends across, and differs
        crossed = model(input_ids=torch.tensor([other_a + b + c])).logits[0, 9:]
    assert not torch.equal(one[:9], two[:9])  # the changed document's own logits changed
    assert torch.equal(one[9:], two[9:])  # the next documents' did not, to the bit
    torch.testing.assert_close(one[9:26], alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(crossed, two[9:26], atol=1e-3)
    check_packing(model)  # the load-time check passes for them


class Crossing(nn.Module):
    """A causal "LM" that mixes every earlier token in (a running mean), positions ignored."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.config = transformers.GPT2Config(vocab_size=VOCAB)

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        x = self.embed(input_ids).cumsum(1)
        return transformers.modeling_outputs.CausalLMOutput(logits=x @ self.embed.weight.T)


def test_a_model_that_attends_across_documents_is_refused() -> None:
    with pytest.raises(ConfigError, match="attends across packed documents"):
        check_packing(Crossing())
    with pytest.raises(ConfigError, match=r"model\.task=causal_lm"):
        check_packing(tiny("gpt2"), "classification")


def test_real_tokens_of_a_padded_batch_are_its_mask(tmp_path: Path) -> None:
    batch = {"input_ids": torch.zeros(2, 5, dtype=torch.long),
             "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])}
    assert int(real_tokens(batch)) == 8
    assert real_tokens((torch.zeros(2), torch.zeros(2))) is None


@pytest.fixture(scope="module")
def text_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.helpers.causal_lm import write_tokenizer

    root = tmp_path_factory.mktemp("pack_text")
    write_tokenizer(root / "tok", vocab_size=300)
    lines = [f"def f{i}(x): return x + {i}" * (1 + i % 5) for i in range(40)]
    (root / "lm").mkdir()
    (root / "lm" / "train.txt").write_text("\n".join(lines[:32]) + "\n")
    (root / "lm" / "test.txt").write_text("\n".join(lines[32:]) + "\n")
    (root / "cls").mkdir()
    (root / "cls" / "train.csv").write_text("text,label\n" + "".join(
        f"{t},{i % 2}\n" for i, t in enumerate(lines)))
    return {"root": root, "tok": root / "tok"}


def test_hf_text_packs_training_and_keeps_evaluation_padded(
        text_folders: dict[str, Path]) -> None:
    from trainkit.config import HFTextConfig
    from trainkit.data.sources.hf_text import PadBatch, TextSamples, hf_text_splits

    cfg = HFTextConfig(name="hf_text", root=str(text_folders["root"] / "lm"), batch_size=4,
                       tokenizer=str(text_folders["tok"]), seq_len=64, pack=True)
    train, val, _ = hf_text_splits(cfg)
    assert isinstance(train.dataset, PackedWindows) and isinstance(train.collate_fn, PackBatch)
    assert len(train.dataset) < 32 and train.shuffle  # windows of several texts
    assert isinstance(val.dataset, TextSamples) and isinstance(val.collate_fn, PadBatch)
    plain = hf_text_splits(HFTextConfig(**{**vars(cfg), "pack": False}))[0]
    assert isinstance(plain.dataset, TextSamples)


def test_packing_a_classification_dataset_is_one_line(text_folders: dict[str, Path]) -> None:
    from trainkit.config import HFTextConfig
    from trainkit.data.sources.hf_text import hf_text_splits

    cfg = HFTextConfig(name="hf_text", root=str(text_folders["root"] / "cls"), batch_size=4,
                       tokenizer=str(text_folders["tok"]), seq_len=64, pack=True)
    with pytest.raises(ConfigError, match="label column"):
        hf_text_splits(cfg)
    with pytest.raises(ConfigError, match=r"data\.pack must be true or false"):
        HFTextConfig(name="hf_text", pack="yes")  # type: ignore[arg-type]
