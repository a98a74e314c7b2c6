"""Tiny Hugging Face causal language models and their text, made offline from local files.

:func:`write_tokenizer` trains a byte-level BPE tokenizer on standard-library modules other than
the fine-tuning data's (so the models do not change as this repository does);
:func:`write_tiny_gpt2` and :func:`write_tiny_llama` save a 2-layer, 64-wide
``GPT2LMHeadModel`` / ``LlamaForCausalLM`` (input and output embeddings tied, 64 positions) with
it; :func:`write_code_lines` writes ``train.txt`` / ``test.txt`` of Python source lines (one text
a line, no label column: causal language modelling).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from tests.helpers.hf_text import STDLIB, code_lines, prose_lines

# pretraining's text: standard-library modules apart from hf_text.SOURCES (the fine-tuning data)
BASE_SOURCES = ["inspect.py", "typing.py", "collections/__init__.py", "logging/__init__.py",
                "subprocess.py", "tarfile.py", "email/message.py", "ast.py"]
POSITIONS = 64  # the models' max_position_embeddings: below data.seq_len's default 128
EOS = "<|endoftext|>"


def base_texts() -> list[str]:
    """The text of the pretraining modules (:data:`BASE_SOURCES`)."""
    return [(STDLIB / name).read_text(encoding="utf-8") for name in BASE_SOURCES]


def write_tokenizer(folder: Path, vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer (GPT-2's kind) trained on :func:`base_texts`, saved in
    ``folder``; its end-of-text token pads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(base_texts(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, bos_token=EOS,
                                   pad_token=EOS)
    fast.save_pretrained(folder)
    return fast


def base_lines() -> list[str]:
    """Pretraining's lines: the English of the standard library's docstrings, so that the
    fine-tuning on code has something to adapt to."""
    return prose_lines()


def pretrain(model: Any, tokenizer: Any, *, steps: int, batch: int = 32) -> None:
    """Train the whole model on lines of :func:`base_lines` for ``steps`` steps: a base that
    knows English, for fine-tuning to adapt to Python."""
    import torch

    lines = base_lines()
    order = torch.randperm(len(lines), generator=torch.Generator().manual_seed(1)).tolist()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    model.train()
    for step in range(steps):
        texts = [lines[i] for i in order[step * batch:(step + 1) * batch]]
        inputs = tokenizer(texts, truncation=True, max_length=POSITIONS, padding=True,
                           return_tensors="pt")
        labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
        loss = model(**inputs, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def write_tiny_gpt2(folder: Path, pretrain_steps: int = 150) -> Path:
    """A ``GPT2LMHeadModel`` (2 layers, 64 wide; ``lm_head`` tied to ``wte``) and its
    tokenizer in ``folder``, pretrained for ``pretrain_steps`` steps (:func:`pretrain`)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = write_tokenizer(folder)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=POSITIONS, n_embd=64, n_layer=2,
                        n_head=2, bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    pretrain(model, tokenizer, steps=pretrain_steps)
    model.save_pretrained(folder)
    return folder


def write_tiny_llama(folder: Path, pretrain_steps: int = 150) -> Path:
    """A Llama-style ``LlamaForCausalLM`` (2 layers, 64 wide, ``tie_word_embeddings=True``)
    and its tokenizer in ``folder``, pretrained for ``pretrain_steps`` steps."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = write_tokenizer(folder)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=POSITIONS, tie_word_embeddings=True,
                         bos_token_id=tokenizer.eos_token_id,
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    pretrain(model, tokenizer, steps=pretrain_steps)
    model.save_pretrained(folder)
    return folder


def write_code_lines(folder: Path, train: int = 256, test: int = 64) -> Path:
    """``train.txt`` and ``test.txt``: lines of Python's sources, one a line; the first
    training text is a long one (many lines joined: more tokens than the models' positions)."""
    rng = random.Random(0)
    lines = rng.sample(code_lines(), train + test)
    folder.mkdir(parents=True, exist_ok=True)
    long = " ".join(lines[:12])
    (folder / "train.txt").write_text("\n".join([long, *lines[1:train]]) + "\n",
                                      encoding="utf-8")
    (folder / "test.txt").write_text("\n".join(lines[train:]) + "\n", encoding="utf-8")
    return folder
