"""Hugging Face ``transformers`` models from a local folder (``model=hf model.path=DIR``).

:func:`from_folder` builds a sequence classifier or a causal language model from a folder
written by ``save_pretrained`` (offline: nothing is downloaded). Such a model computes its own
loss when the batch carries ``labels``; :func:`hf_forward` and :func:`model_loss` are the
``forward`` and ``loss`` that ``configs/model/hf.yaml`` sets, so the run trains on that loss and
evaluates the logits without glue of your own. transformers' load report is said in trainkit's
lines (:mod:`trainkit.core.library_logs` turns its own off). Needs
``pip install 'trainkit[finetune]'``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainkit.core.errors import ConfigError, TrainkitError, one_line
from trainkit.core.library_logs import quiet_libraries
from trainkit.data.sources.hf_text import IGNORE, load_tokenizer, pad_id

log = logging.getLogger("trainkit")

TASKS = ("classification", "causal_lm")


def from_folder(path: str | None, task: str = "classification", num_labels: int | None = None,
                pack: bool = False) -> nn.Module:
    """The model saved in folder ``path``, for ``task``.

    Args:
        path: a folder ``save_pretrained`` wrote (``config.json`` and the weights).
        task: ``classification`` (``AutoModelForSequenceClassification``; a head of
            ``num_labels`` classes, re-initialised where the folder's differs or is missing) or
            ``causal_lm`` (``AutoModelForCausalLM``; ``num_labels``, the data's vocabulary,
            must fit the model's).
        pack: the data is packed (``data.pack=true``): the model must keep each token's
            attention inside its document given restarting position ids (:func:`check_packing`).

    Raises:
        ConfigError: no such folder, no model in it, an unknown task, or packing the model
            cannot keep apart.
    """
    if not path:
        raise ConfigError("model=hf needs model.path: the folder of the model (save_pretrained's "
                          "config.json and weights), e.g. model.path=/models/bert-base")
    transformers = _transformers()
    folder = Path(path)
    if task not in TASKS:
        raise ConfigError(f"model.task={task!r}: use {TASKS[0]!r} or {TASKS[1]!r}")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"model.path={path}: no config.json there; give a folder that "
                          "save_pretrained wrote (config.json and the weights)")
    try:
        with quiet_libraries():  # its load report said in one line below, without colours
            if task == "causal_lm":
                model, report = transformers.AutoModelForCausalLM.from_pretrained(
                    folder, output_loading_info=True)
            else:
                model, report = transformers.AutoModelForSequenceClassification.from_pretrained(
                    folder, num_labels=num_labels, ignore_mismatched_sizes=True,
                    output_loading_info=True)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.path={path}: transformers cannot load it "
                          f"({one_line(err, 120)})") from None
    _log_report(path, report)
    if task == "causal_lm" and getattr(model, "loss_type", None) is None:
        model.loss_type = "ForCausalLM"  # what transformers falls back to, warning every run
    vocab = model.config.get_text_config().vocab_size
    if task == "causal_lm" and num_labels is not None and num_labels > vocab:
        raise ConfigError(f"the tokenizer has {num_labels} tokens but the model's vocabulary "
                          f"{vocab}: give the tokenizer the model was trained with")
    if model.config.pad_token_id is None:  # a batch's padding, found by the classifier
        model.config.pad_token_id = pad_id(load_tokenizer(path, key="model.path"))
    if pack:
        check_packing(model, task)
    return model


@torch.no_grad()
def check_packing(model: nn.Module, task: str = "causal_lm") -> None:
    """Refuse a model that attends across packed documents: two documents in one window,
    positions restarting, must give the second the logits it has alone.

    Raises:
        ConfigError: the task is not causal_lm, or the model's attention crosses documents
            (its attention implementation does not read packed position ids).
    """
    if task != "causal_lm":
        raise ConfigError(f"data.pack=true is for model.task=causal_lm, not {task!r}")
    param = next(model.parameters())
    ids = torch.arange(6, device=param.device).unsqueeze(0) % model.config.get_text_config(
        ).vocab_size
    if model.config.pad_token_id is not None:  # a window's padding, as training has it
        ids[0, 0] = model.config.pad_token_id
    training = model.training
    model.eval()
    try:
        # quiet: transformers' once-a-process advice to pass an attention mask with padding
        # (packed windows have none by design) is given here, to no one
        with quiet_libraries():
            both = model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]],
                                                                 device=param.device),
                         use_cache=False).logits[:, 3:]
            alone = model(input_ids=ids[:, 3:], use_cache=False).logits
    finally:
        model.train(training)
    if not torch.allclose(both.float(), alone.float(), rtol=1e-3, atol=1e-3):
        raise ConfigError(
            f"data.pack=true: {type(model).__name__} with attn_implementation="
            f"{getattr(model.config, '_attn_implementation', None)} attends across packed "
            "documents; use data.pack=false (padded) or an attention that reads position_ids "
            "(sdpa, eager, flash_attention_2)")


def _log_report(path: str, report: Mapping[str, Any]) -> None:
    """transformers' load report (weights new, unused or re-initialised) as one line each."""
    said = {"missing_keys": "new (initialised here)", "mismatched_keys": "of another shape "
            "(re-initialised)", "unexpected_keys": "in the folder but not in the model (unused)"}
    for key, words in said.items():
        names = sorted(name if isinstance(name, str) else name[0]
                       for name in report.get(key) or ())
        if names:
            more = f" and {len(names) - 4} more" if len(names) > 4 else ""
            log.info("model.path=%s: %d weights %s: %s%s", path, len(names), words,
                     ", ".join(names[:4]), more)


def positions(model: nn.Module) -> int | None:
    """The longest text ``model`` takes, in tokens (its ``max_position_embeddings``), if it
    says."""
    config = getattr(model, "config", None)
    if not hasattr(config, "get_text_config"):  # not a transformers model
        return None
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def hf_forward(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple[Any, Any]:
    """``model(**batch)`` -> its logits (carrying its own loss, for :func:`model_loss`) and the
    labels (packed windows: :mod:`trainkit.data.sources.packing`). A causal LM's are shifted
    (position ``t`` predicts token ``t + 1``) and flattened,
    so that accuracy metrics see ``[N, vocab]`` logits and ``[N]`` targets (padding: -100)."""
    # packed windows (position ids, no attention mask): no KV cache, whose presence turns off
    # transformers' reading of documents from the position ids
    out = model(**batch, use_cache=False) if "position_ids" in batch else model(**batch)
    logits, labels = out.logits, batch["labels"]
    if labels.dim() == 2:  # a causal LM: token labels
        logits, labels = logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
    logits.model_loss = out.loss  # the model's own loss of this batch
    return logits, labels


def count_targets(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The labels of ``batch`` that count in the loss (not -100; a causal LM's shifted as in
    :func:`hf_forward`), as a 0-d tensor: the training step's and evaluation's loss is the mean
    over the window's (the split's) valid tokens, not a mean of batch means."""
    labels = batch["labels"]
    if labels.dim() == 2:
        labels = labels[:, 1:]
    return (labels != IGNORE).sum()


hf_forward.count_targets = count_targets  # type: ignore[attr-defined]


def model_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss the model computed itself in :func:`hf_forward` (a ``loss`` node)."""
    loss = getattr(logits, "model_loss", None)
    if loss is None:
        raise TrainkitError("loss=model_loss takes the loss a Hugging Face model computed in "
                            "trainkit.models.hf.hf_forward: set forward to it (model=hf does)")
    return loss


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise TrainkitError("Hugging Face models need transformers: pip install "
                            "'trainkit[finetune]'") from None
    return transformers


@torch.no_grad()
def classify(model: nn.Module, tokenizer: Any, texts: list[str], *, seq_len: int,
             classes: list[str], topk: int) -> list[dict[str, Any]]:
    """Rows ``{"input": text, "classes": the top-k names, "probs": their probabilities}``."""
    device = next(model.parameters()).device
    limit = min(seq_len, positions(model) or seq_len)
    batch = tokenizer(texts, truncation=True, max_length=limit, padding=True,
                      return_tensors="pt").to(device)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    probs, index = logits.float().softmax(-1).topk(min(topk, len(classes)), dim=-1)
    return [{"input": text, "classes": [classes[i] for i in row.tolist()], "probs": p.tolist()}
            for text, row, p in zip(texts, index.cpu(), probs.cpu())]


@torch.no_grad()
def generate(model: nn.Module, tokenizer: Any, prompts: list[str], *, seq_len: int,
             max_new_tokens: int) -> list[dict[str, Any]]:
    """Rows ``{"input": prompt, "text": its continuation}`` (greedy, at most
    ``max_new_tokens`` tokens; the prompts padded on the left, as generation needs)."""
    device = next(model.parameters()).device
    limit = positions(model)
    if limit is not None:  # the prompt and its continuation within the model's positions
        max_new_tokens = min(max_new_tokens, limit - 1)
        seq_len = min(seq_len, limit - max_new_tokens)
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, truncation=True, max_length=seq_len, padding=True,
                      return_tensors="pt").to(device)
    with quiet_libraries():  # generate's notes on its settings, every call
        out = model.generate(input_ids=batch["input_ids"],
                             attention_mask=batch["attention_mask"],
                             max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad_id(tokenizer))
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:],
                                   skip_special_tokens=True)
    return [{"input": prompt, "text": text} for prompt, text in zip(prompts, texts)]
