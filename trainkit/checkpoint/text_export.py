"""``trainkit export`` of a Hugging Face text model (``model=hf``): a folder of weights, the
tokenizer and ``model.json``, LoRA adapters merged into the weights; or the adapters alone.

* ``safetensors``: the merged model as ``save_pretrained`` writes it (``model.safetensors``,
  tied weights once, ``config.json`` naming the classes) and the tokenizer beside: the folder
  also loads with ``AutoModelForSequenceClassification.from_pretrained(folder)`` (or
  ``AutoModelForCausalLM``, its embeddings tied as they were). ``pt``: the ``state_dict`` as
  ``model.pt``, with the same ``config.json`` and tokenizer.
* ``pt2``: a ``torch.export`` program taking ``input_ids`` and ``attention_mask`` (int64
  ``[N, T]``, any N and T up to the run's ``data.seq_len`` or the model's positions) and
  returning the logits, with torch alone.
* :func:`export_adapters`: the adapters in PEFT's format (``adapter_config.json``,
  ``adapter_model.safetensors``) for ``PeftModel.from_pretrained(base, folder)``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainkit.checkpoint.export import DTYPES, FORMATS
from trainkit.checkpoint.load import MODEL_JSON
from trainkit.core.errors import TrainkitError, one_line
from trainkit.core.library_logs import quiet_libraries
from trainkit.models.hf import positions
from trainkit.models.lora import merged, save_adapters, task_type


class TextLogits(nn.Module):
    """``model(input_ids, attention_mask).logits``: a transformers model as a plain function."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def export_text(model: nn.Module, out: Path, *, fmt: str, dtype: str, tokenizer: Any,
                seq_len: int, info: Mapping[str, Any]) -> Path:
    """Write ``model`` with its adapters merged as ``fmt`` in ``dtype`` to the new folder
    ``out``, with the tokenizer and ``model.json`` (``info`` and what the files are); a pt2
    program takes texts of up to ``seq_len`` tokens (the model's positions at most). A
    classifier's ``config.json`` names ``info["classes"]`` (``id2label``, ``label2id``).

    Raises:
        TrainkitError: a bad format or dtype, or the folder cannot be written (one line).
    """
    if fmt not in FORMATS:
        raise TrainkitError(f"--format {fmt}: use one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise TrainkitError(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")
    plain = merged(model).to("cpu", DTYPES[dtype]).eval()
    seq_len = min(seq_len, positions(plain) or seq_len)  # a longer text indexes past them
    name_classes(plain, info.get("classes"))
    file = f"model.{fmt}"
    with new_folder(out) as tmp:
        if fmt == "pt2":
            torch.export.save(program(plain, seq_len), tmp / file)
        else:
            write_weights(plain, tmp, fmt)
        tokenizer.save_pretrained(tmp)
        inputs = ("input_ids and attention_mask, int64 [N, T], from the tokenizer beside; "
                  "returns the logits" if fmt == "pt2" else
                  "the model's keyword arguments (input_ids, attention_mask) from the "
                  "tokenizer beside")
        record = {"format": fmt, "file": file, "dtype": str(DTYPES[dtype]).removeprefix("torch."),
                  **info, "seq_len": seq_len, "input": inputs}
        (tmp / MODEL_JSON).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return out


def write_weights(model: nn.Module, folder: Path, fmt: str) -> None:
    """``model``'s weights and ``config.json`` in ``folder``, as transformers writes them:
    ``safetensors`` through ``save_pretrained`` (a tied weight -- GPT-2's and most causal LMs'
    output embedding -- written once and tied again when loaded), ``pt`` a ``state_dict``."""
    try:
        with quiet_libraries():  # no "Writing model shards" bar
            if fmt == "safetensors":
                model.save_pretrained(folder)  # model.safetensors, config.json and the rest
                if not (folder / "model.safetensors").is_file():  # sharded: not one file
                    raise TrainkitError(f"transformers wrote {folder.name} in shards, not one "
                                        "model.safetensors: export --format pt")
            else:
                torch.save({k: t.detach().contiguous() for k, t in model.state_dict().items()},
                           folder / "model.pt")
                model.config.save_pretrained(folder)  # config.json: a transformers folder too
    except TrainkitError:
        raise
    except Exception as err:  # a library's refusal (shared tensors, a full disk): one line
        raise TrainkitError(f"cannot write the {fmt} weights of {type(model).__name__} "
                            f"({one_line(err, 100)})") from None


def name_classes(model: nn.Module, classes: Any) -> None:
    """Write a classifier's class names into its config (``id2label``/``label2id``: what
    ``from_pretrained`` and transformers' pipelines show instead of ``LABEL_0``)."""
    config = getattr(model, "config", None)
    if config is None or not classes or len(classes) != getattr(config, "num_labels", None):
        return  # a causal LM's "classes" are its vocabulary: not labels
    if task_type(model) != "SEQ_CLS":
        return
    config.id2label = dict(enumerate(map(str, classes)))
    config.label2id = {name: i for i, name in config.id2label.items()}


def export_adapters(model: nn.Module, out: Path, *, tokenizer: Any = None) -> Path:
    """Write the LoRA adapters of ``model`` alone, in PEFT's format, to the new folder ``out``."""
    with new_folder(out) as tmp:
        try:
            with quiet_libraries():
                save_adapters(model, str(tmp))
        except TrainkitError:
            raise
        except Exception as err:  # PEFT's refusal: one line
            raise TrainkitError(f"cannot write the adapters of {type(model).__name__} "
                                f"({one_line(err, 100)})") from None
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return out


def program(model: nn.Module, max_length: int) -> torch.export.ExportedProgram:
    """``model``'s logits as a ``torch.export`` program for any batch size and any length up
    to ``max_length`` tokens."""
    ids = torch.ones((2, 8), dtype=torch.long)
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0  # with padding: an all-ones example would trace the mask away
    batch = torch.export.Dim("batch", min=1)
    length = torch.export.Dim("length", min=2, max=max_length)
    shapes = ({0: batch, 1: length}, {0: batch, 1: length})
    try:
        return torch.export.export(TextLogits(model).eval(), (ids, mask),
                                   dynamic_shapes=shapes)
    except Exception as err:  # the tracer's errors are long; the model's code is what it met
        raise TrainkitError(
            f"torch.export cannot trace {type(model).__name__} ({one_line(err, 100)}): export "
            "--format safetensors, which any model can use") from None


@contextlib.contextmanager
def new_folder(out: Path) -> Iterator[Path]:
    """A folder written beside ``out`` and renamed to it at the end: whole or not at all."""
    if out.exists():
        raise TrainkitError(f"export folder {out} exists: remove it, or give another --out")
    if not out.parent.is_dir():
        raise TrainkitError(f"cannot write {out}: folder {out.parent} does not exist")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # this process's own, left by a kill
    tmp.mkdir()
    try:
        yield tmp
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
