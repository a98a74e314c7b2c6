"""A tiny Hugging Face text classifier and its data, made offline from local text.

:func:`write_tiny_bert` saves a 2-layer BERT (hidden 32, built from a config, its weights the
"pretrained" ones) with a WordPiece tokenizer trained on Python's own sources;
:func:`write_code_or_prose` writes a CSV dataset of lines labelled ``code`` (Python's sources) or
``prose`` (the licence texts in /usr/share/common-licenses, else Python's docstrings).
"""

from __future__ import annotations

import csv
import random
import sysconfig
from pathlib import Path

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = ["argparse.py", "dataclasses.py", "functools.py", "json/encoder.py", "pathlib.py"]
LICENCES = Path("/usr/share/common-licenses")


def code_lines() -> list[str]:
    lines = []
    for name in SOURCES:
        text = (STDLIB / name).read_text(encoding="utf-8")
        lines += [ln.strip() for ln in text.splitlines()
                  if len(ln.strip()) > 25 and not ln.strip().startswith(("#", '"', "'"))]
    return lines


def prose_lines() -> list[str]:
    files = sorted(LICENCES.glob("*")) if LICENCES.is_dir() else []
    text = " ".join(f.read_text(encoding="utf-8", errors="ignore") for f in files
                    if f.is_file())
    if len(text) < 20_000:  # no licences here: the standard library's docstrings
        import pydoc

        text = " ".join(pydoc.getdoc(__import__(m)) for m in ("argparse", "json", "pathlib"))
    words = text.split()
    return [" ".join(words[i:i + 12]) for i in range(0, len(words) - 12, 12)]


def write_tiny_bert(folder: Path) -> Path:
    """A BERT sequence classifier config + random weights and its tokenizer in ``folder``."""
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
    BertForSequenceClassification(config).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def write_code_or_prose(folder: Path, train: int = 192, test: int = 64) -> Path:
    """``train.csv`` and ``test.csv`` (columns text, label) of code and prose lines."""
    rng = random.Random(0)
    code, prose = code_lines(), prose_lines()
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
