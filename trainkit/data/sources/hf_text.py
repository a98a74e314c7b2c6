"""``data=hf_text``: text from a Hugging Face dataset or files, tokenised for a ``transformers``
model.

``data.root`` is a folder ``DatasetDict.save_to_disk`` wrote, a folder of data files that
``datasets.load_dataset`` reads (``train.csv``/``test.csv``, ``train.jsonl``, ``train.txt`` one
text a line, parquet, ...), or the name of a dataset in the local Hugging Face cache. Training
reads its ``train`` split, evaluation the first of ``validation``, ``val``, ``test``.

Each batch is tokenised by the tokenizer in folder ``data.tokenizer`` (the model's folder by
default), truncated to ``data.seq_len`` tokens and padded to its own longest text:
``{"input_ids", "attention_mask", "labels"}``. With a ``data.label_column`` the task is
classification (``labels``: class indices; the classes are the column's ``ClassLabel`` names or
its sorted values); without one, causal language modelling (``labels``: the tokens, -100 on the
padding; ``data.pack=true``: packed windows, :mod:`.packing`). Through ``make_loader``: each
rank its shard, and a resumed run reads exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from trainkit.config import HFTextConfig
from trainkit.core.errors import ConfigError, TrainkitError, one_line
from trainkit.core.library_logs import quiet_libraries
from trainkit.core.runtime import Runtime
from trainkit.data.sources.packing import PackBatch, PackedWindows
from trainkit.data.sources.source import Loaded, MapStyle, Options, Source

EVAL_SPLITS = ("validation", "val", "test")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json",
                   "tokenizer.model")
IGNORE = -100  # the label of padding: left out of the loss (transformers' and torch's default)
log = logging.getLogger("trainkit")


class TextSamples(Dataset):
    """A split's texts (and labels), tokenised a batch at a time in :meth:`__getitems__`."""

    def __init__(self, split: Any, tokenizer: Any, *, seq_len: int, text_column: str,
                 label_column: str | None, classes: Sequence[str] | None) -> None:
        self.split, self.tokenizer, self.seq_len = split, tokenizer, seq_len
        self.text_column, self.label_column = text_column, label_column
        # values -> class indices, unless the column holds ClassLabel indices already
        self.index = ({c: i for i, c in enumerate(classes)}
                      if classes and not _class_label(split, label_column) else None)

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        rows = self.split[list(indices)]
        encoded = self.tokenizer(rows[self.text_column], truncation=True,
                                 max_length=self.seq_len)
        samples = [{"input_ids": ids} for ids in encoded["input_ids"]]
        if self.label_column is not None:
            for sample, label in zip(samples, rows[self.label_column]):
                sample["labels"] = self.index[str(label)] if self.index else int(label)
        return samples


class PadBatch:
    """Samples -> one batch padded to its longest: ``input_ids`` (``pad`` after the text),
    ``attention_mask`` (1 on the text) and ``labels`` (class indices, or the tokens with -100
    on the padding)."""

    def __init__(self, pad: int) -> None:
        self.pad = pad

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        longest = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), longest), self.pad, dtype=torch.long)
        mask = torch.zeros((len(samples), longest), dtype=torch.long)
        for row, sample in enumerate(samples):
            n = len(sample["input_ids"])
            ids[row, :n] = torch.tensor(sample["input_ids"], dtype=torch.long)
            mask[row, :n] = 1
        if "labels" in samples[0]:
            labels = torch.tensor([s["labels"] for s in samples], dtype=torch.long)
        else:
            labels = ids.masked_fill(mask == 0, IGNORE)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def hf_text_splits(cfg: HFTextConfig, *, eval_max_batches: int | None = None) -> Loaded:
    """The training and evaluation samples of ``data.root``'s text, and the class count (the
    tokenizer's vocabulary for causal language modelling); ``eval_max_batches`` bounds the
    evaluation to samples spread evenly over its split."""
    if not cfg.tokenizer:
        raise ConfigError("data=hf_text needs data.tokenizer: the folder of the model's "
                          "tokenizer (configs/data/hf_text.yaml takes model.path's)")
    tokenizer = load_tokenizer(cfg.tokenizer)
    splits = read_splits(cfg.root)
    train = splits["train"]
    val = next((splits[name] for name in EVAL_SPLITS if name in splits), None)
    if cfg.text_column not in train.column_names:
        raise ConfigError(f"data.text_column={cfg.text_column!r} is not a column of "
                          f"{cfg.root} (its columns: {', '.join(train.column_names)})")
    label = cfg.label_column if cfg.label_column in train.column_names else None
    classes = class_names(train, label) if label else None
    seq_len = fitted_seq_len(cfg.seq_len, cfg.tokenizer, tokenizer)
    common = {"tokenizer": tokenizer, "seq_len": seq_len, "text_column": cfg.text_column,
              "label_column": label, "classes": classes}

    if cfg.pack and label:
        raise ConfigError(f"data.pack=true packs a causal LM's documents, but the data has a "
                          f"label column ({label!r}): classification pads each text")

    def load(split: Any, training: bool) -> MapStyle:
        if training and cfg.pack:  # evaluation stays padded: the same texts either way
            return packed_split(split[cfg.text_column], tokenizer, seq_len=seq_len,
                                batch_size=cfg.batch_size, num_workers=cfg.num_workers,
                                pin_memory=cfg.pin_memory, drop_last=cfg.drop_last)
        return MapStyle(
            TextSamples(split, **common), cfg.batch_size if training else cfg.eval_batch_size,
            shuffle=training, num_workers=cfg.num_workers, pin_memory=cfg.pin_memory,
            drop_last=cfg.drop_last and training, collate_fn=PadBatch(pad_id(tokenizer)),
            max_batches=None if training else eval_max_batches, classes=classes)

    count = len(classes) if classes else len(tokenizer)
    return load(train, True), (load(val, False) if val is not None else None), count


def packed_split(texts: Sequence[str], tokenizer: Any, *, seq_len: int, batch_size: int,
                 **loader: Any) -> MapStyle:
    """The texts packed into windows of ``seq_len`` tokens (:mod:`.packing`), said in a line."""
    windows = PackedWindows(texts, tokenizer, seq_len=seq_len)
    log.info("data.pack: %d texts in %d windows of %d tokens (%.0f%% filled)", len(texts),
             len(windows), seq_len, 100 * windows.real_tokens() / max(len(windows) * seq_len, 1))
    return MapStyle(windows, batch_size, shuffle=True, collate_fn=PackBatch(pad_id(tokenizer)),
                    **loader)


def fitted_seq_len(seq_len: int, folder: str, tokenizer: Any) -> int:
    """``seq_len``, or the model's limit where it is shorter (its ``max_position_embeddings``
    in ``folder``'s ``config.json``, the tokenizer's ``model_max_length``), said in one line:
    a longer text would index past the position embeddings mid-run."""
    limits = [n for n in (tokenizer.model_max_length, _positions(folder))
              if isinstance(n, int) and 0 < n < 10**8]
    if limits and min(limits) < seq_len:
        log.info("data.seq_len=%d is longer than the model takes (%d tokens): texts are cut to "
                 "%d tokens", seq_len, min(limits), min(limits))
        return min(limits)
    return seq_len


def _positions(folder: str) -> int | None:
    """The ``max_position_embeddings`` of the model config in ``folder``, if one is there."""
    if not (Path(folder) / "config.json").is_file():
        return None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder).get_text_config()
    except (OSError, ValueError):  # not a config transformers knows: no limit known
        return None
    return getattr(config, "max_position_embeddings", None)


def read_splits(root: str) -> Any:
    """The ``DatasetDict`` at ``root``: saved with ``save_to_disk``, data files, or a dataset
    name in the local Hugging Face cache."""
    try:
        import datasets
    except ImportError:
        raise TrainkitError("data=hf_text needs the datasets package: pip install "
                            "'trainkit[finetune]'") from None
    try:
        with quiet_libraries():  # no "Generating train split" bars
            if (Path(root) / "dataset_dict.json").is_file():
                splits = datasets.load_from_disk(root)
            else:
                splits = datasets.load_dataset(root)
    except (OSError, ValueError, FileNotFoundError) as err:
        raise ConfigError(f"data.root={root}: no text dataset there ({one_line(err, 120)}); "
                          "give a folder of train.csv/.jsonl/.txt files or a saved "
                          "DatasetDict") from None
    if "train" not in splits:
        raise ConfigError(f"data.root={root} has no train split (its splits: "
                          f"{', '.join(splits)}): name the training file train.*")
    return splits


def class_names(split: Any, column: str) -> list[str]:
    """The label column's ``ClassLabel`` names, else its distinct values, sorted."""
    if _class_label(split, column):
        return list(split.features[column].names)
    values = sorted(set(split[column]))
    return [str(v) for v in values]


def _class_label(split: Any, column: str | None) -> bool:
    return column is not None and hasattr(split.features.get(column), "names")


def load_tokenizer(path: str, *, key: str = "data.tokenizer") -> Any:
    """The tokenizer saved in folder ``path`` (``AutoTokenizer``); ``key`` names the setting.

    Raises:
        ConfigError: the folder has no tokenizer files, or they do not load.
    """
    folder = Path(path)
    if not folder.is_dir() or not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{key}={path} holds no tokenizer: save one there "
                          "(tokenizer.save_pretrained), or set data.tokenizer to one's folder")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TrainkitError("tokenizing text needs transformers: pip install "
                            "'trainkit[finetune]'") from None
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{key}={path}: its tokenizer does not load "
                          f"({one_line(err, 120)})") from None


def pad_id(tokenizer: Any) -> int:
    """The token id padding uses: the tokenizer's pad token, else its end-of-text token."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (
        tokenizer.eos_token_id)
    if pad is None:
        raise ConfigError("the tokenizer has neither a pad nor an end-of-text token: add one "
                          "(tokenizer.pad_token = ...) and save it again")
    return int(pad)


def load(cfg: HFTextConfig, runtime: Runtime, options: Options) -> Loaded:
    """:func:`hf_text_splits` as :data:`trainkit.data.sources.SOURCES` calls it."""
    return hf_text_splits(cfg, eval_max_batches=options.eval_max_batches)


SOURCE = Source("hf_text", HFTextConfig, load, takes="text", reader_replaces=False)
