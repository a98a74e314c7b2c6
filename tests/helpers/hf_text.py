"""A tiny Hugging Face text classifier and its data, made offline from local text.

:func:`write_tiny_bert` saves a 2-layer BERT (hidden 32, built from a config, "pretrained" here
on other lines of the same two kinds) with a WordPiece tokenizer trained on Python's own sources;
:func:`write_code_or_prose` writes a CSV dataset of lines labelled ``code`` (Python's sources) or
``prose`` (the English of its docstrings).
"""

from __future__ import annotations

import csv
import random
import sysconfig
from pathlib import Path
from typing import Any

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = ["argparse.py", "dataclasses.py", "functools.py", "json/encoder.py", "pathlib.py"]
HELD = 500  # the last lines of each kind: pretraining's, never the fine-tuning data's


def code_lines() -> list[str]:
    lines = []
    for name in SOURCES:
        text = (STDLIB / name).read_text(encoding="utf-8")
        lines += [ln.strip() for ln in text.splitlines()
                  if len(ln.strip()) > 25 and not ln.strip().startswith(("#", '"', "'"))]
    return lines


def prose_lines() -> list[str]:
    """12-word lines of the English in the standard library's docstrings."""
    import ast

    words: list[str] = []
    for path in sorted(STDLIB.glob("*.py"))[:80]:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="ignore"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                words += (ast.get_docstring(node) or "").split()
    return [" ".join(words[i:i + 12]) for i in range(0, len(words) - 12, 12)]


def write_tiny_bert(folder: Path, pretrain_steps: int = 20) -> Path:
    """A BERT sequence classifier and its tokenizer in ``folder``: built from a config,
    pretrained for ``pretrain_steps`` steps (:func:`pretrain`), its head then re-initialised."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer.train_from_iterator(code_lines() + prose_lines()[:2000], trainers.WordPieceTrainer(
        vocab_size=600, special_tokens=special, show_progress=False))
    from tokenizers.processors import TemplateProcessing

    tokenizer.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]",
                                   unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                   mask_token="[MASK]")
    config = BertConfig(vocab_size=len(fast), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=128,
                        pad_token_id=0, num_labels=2)
    import torch

    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    pretrain(model, fast, steps=pretrain_steps)
    model.classifier.reset_parameters()  # a new head: what fine-tuning trains from scratch
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def pretrain(model: Any, tokenizer: Any, *, steps: int, batch: int = 32) -> None:
    """Train the whole model on code or prose lines (the last ones: not the fine-tuning
    data's) for ``steps`` steps: an encoder whose features tell the two apart."""
    import torch

    n = min(HELD, steps * batch // 2)
    code, prose = code_lines()[-n:], prose_lines()[-n:]
    texts, labels = code + prose, [0] * len(code) + [1] * len(prose)
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(1)).tolist()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model.train()
    for step in range(steps):
        index = order[step * batch:(step + 1) * batch]
        inputs = tokenizer([texts[i] for i in index], truncation=True, max_length=64,
                           padding=True, return_tensors="pt")
        loss = model(**inputs, labels=torch.tensor([labels[i] for i in index])).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def write_code_or_prose(folder: Path, train: int = 192, test: int = 64) -> Path:
    """``train.csv`` and ``test.csv`` (columns text, label) of code and prose lines."""
    rng = random.Random(0)
    code, prose = code_lines()[:-HELD], prose_lines()[:-HELD]  # not the pretraining lines
    rows = [(line, "code") for line in rng.sample(code, (train + test) // 2)]
    rows += [(line, "prose") for line in rng.sample(prose, (train + test) // 2)]
    rng.shuffle(rows)
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", rows[:train]), ("test", rows[train:])):
        with open(folder / f"{name}.csv", "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "label"])
            writer.writerows(part)
    return folder
