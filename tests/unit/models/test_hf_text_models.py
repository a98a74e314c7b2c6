"""Hugging Face text models in trainkit, without a training run: PEFT's task type from what a
model is, a folder loaded quietly (its load report one line each), texts cut to the model's
positions, a merged export that names the classes and fails in one line."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.causal_lm import write_tokenizer
from trainkit.core.errors import TrainkitError


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A byte-level BPE tokenizer trained on this repository (once for the module)."""
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"), vocab_size=300)


def _gpt2(positions: int = 64) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=positions, n_embd=16,
                                      n_layer=1, n_head=2))


def _bert(num_labels: int = 2) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, num_labels=num_labels))


def test_the_peft_task_type_is_what_transformers_says_the_model_is() -> None:
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

    from trainkit.models.lora import task_type

    class MyLM(type(_gpt2())):  # a subclass no auto mapping lists
        pass

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2))
    gpt2 = _gpt2()
    assert type(gpt2).__name__ == "GPT2LMHeadModel"  # no "ForCausalLM" in its name
    assert task_type(gpt2) == task_type(llama) == "CAUSAL_LM"
    assert task_type(MyLM(gpt2.config)) == "CAUSAL_LM"
    assert task_type(_bert()) == "SEQ_CLS"
    assert task_type(BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                          num_attention_heads=2, intermediate_size=32))) is None
    assert task_type(nn.Linear(2, 2)) is None


def test_lora_on_gpt2_is_a_causal_lm_peft_model_without_warnings() -> None:
    from trainkit.models.lora import apply_lora

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PEFT's fan_in_fan_out warning for Conv1D: an error
        model = apply_lora(_gpt2(), {"r": 2, "target_modules": ["c_attn"]})
    assert type(model).__name__ == "PeftModelForCausalLM"
    assert model.peft_config["default"].task_type == "CAUSAL_LM"


def test_a_folder_loads_quietly_with_its_load_report_in_one_line(
        tmp_path: Path, tokenizer: Any, capfd: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    from transformers.utils import logging as hf_logging

    from trainkit.models.hf import from_folder

    _bert(num_labels=3).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    capfd.readouterr()
    before = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    with caplog.at_level(logging.INFO, logger="trainkit"):
        model = from_folder(str(tmp_path), "classification", num_labels=2)  # a new head
    out, err = capfd.readouterr()
    for noise in ("LOAD REPORT", "\x1b[", "Loading weights", "it/s]"):
        assert noise not in out + err, (noise, out + err)
    lines = [r.getMessage() for r in caplog.records if "weights of another shape" in
             r.getMessage()]
    assert lines == [f"model.path={tmp_path}: 2 weights of another shape (re-initialised): "
                     "classifier.bias, classifier.weight"], caplog.text
    assert model.config.num_labels == 2
    assert (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()) == before


def test_texts_are_cut_to_the_models_positions_with_one_line(
        tmp_path: Path, tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    from trainkit.data.sources.hf_text import fitted_seq_len

    _gpt2(positions=64).save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="trainkit"):
        assert fitted_seq_len(128, str(tmp_path), tokenizer) == 64
        assert fitted_seq_len(32, str(tmp_path), tokenizer) == 32
    assert [r.getMessage() for r in caplog.records] == [
        "data.seq_len=128 is longer than the model takes (64 tokens): texts are cut to 64 "
        "tokens"]


def test_the_merged_export_names_the_classes_in_config_json(tmp_path: Path, tokenizer: Any
                                                            ) -> None:
    from transformers import AutoConfig

    from trainkit.checkpoint.text_export import export_text

    export_text(_bert(), tmp_path / "out", fmt="safetensors", dtype="fp32", tokenizer=tokenizer,
                seq_len=32, info={"classes": ["code", "prose"]})
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["id2label"] == {"0": "code", "1": "prose"}
    assert config["label2id"] == {"code": 0, "prose": 1}
    assert AutoConfig.from_pretrained(tmp_path / "out").id2label == {0: "code", 1: "prose"}


def test_an_export_that_cannot_be_written_is_one_line_and_leaves_no_folder(
        tmp_path: Path, tokenizer: Any) -> None:
    from trainkit.checkpoint.text_export import export_text

    with pytest.raises(TrainkitError) as caught:  # not a transformers model: no save_pretrained
        export_text(nn.Linear(2, 2), tmp_path / "out", fmt="safetensors", dtype="fp32",
                    tokenizer=tokenizer, seq_len=32, info={})
    assert "\n" not in str(caught.value) and "cannot write the safetensors weights of Linear" in (
        str(caught.value)), str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_tied_weights_written_once_load_into_the_model(tmp_path: Path) -> None:
    from trainkit.checkpoint.load import with_shared

    model = _gpt2()
    weights = {k: torch.randn_like(v) for k, v in model.state_dict().items()
               if k != "lm_head.weight"}  # as save_pretrained writes a tied model
    filled = with_shared(model, weights)
    assert filled["lm_head.weight"] is weights["transformer.wte.weight"]
    assert with_shared(nn.Linear(2, 2), {"weight": torch.ones(2, 2)}).keys() == {"weight"}
