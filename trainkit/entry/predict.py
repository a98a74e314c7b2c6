"""``trainkit predict RUN_DIR inputs=FOLDER|test|train out=FILE [ckpt=best] [topk=5]
[predict=pkg.module.function] [max_new_tokens=50] [key=value ...]``.

Runs a finished run's model over a folder of images (``.png``/``.jpg``/..., its subfolders' too, in
sorted order, read as the run read its evaluation images -- an image-folder run's resize and centre
crop, a tensor dataset's mode and size -- and normalised as its loaders normalise, as the run
recorded in ``RUN_DIR/inputs.json``: the data itself is not needed) or over a split
of its data (``test``: the one it evaluated on, ``train``): an image folder's files, or a tensor
dataset's or your own ``Dataset``'s samples by index. It writes one row per input, in input order:
``out.jsonl`` rows ``{"input": path or index, "classes": top-k names, "probs": their
probabilities}``, or ``out.pt`` with the raw outputs (``{"inputs": [...], "outputs": tensor}``).
A model that is not a classifier names a function of its own, ``predict=pkg.module.function``,
called as ``function(outputs, inputs)`` for each batch and returning a list of JSON rows. An
input that cannot be decoded stops it with one line naming it; with ``data.skip_corrupt=true``,
as in training, it gets no row and is said and counted instead. Under
torchrun each rank predicts its share and rank 0 writes the rows in order. Exit status: 0 when
written, 2 on bad input (an existing ``out`` is left as it is). Without ckpt=: ``best`` where the
run kept one, else ``last``.

A Hugging Face text run (``model=hf``, ``data=hf_text``) predicts over texts: ``inputs=test|train``
(its split's texts) or a text file (one input a line). A classifier's rows are ``{"input": text,
"classes", "probs"}``; a causal language model's ``{"input": prompt, "text": continuation}``
(greedy, ``max_new_tokens=50``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from trainkit.checkpoint.export import Inputs, Normalized
from trainkit.core.cuda_settings import use_device
from trainkit.core.errors import TrainkitError, one_line
from trainkit.core.runtime import Runtime
from trainkit.data import (
    IMAGE_SUFFIXES,
    Samples,
    TensorData,
    UnreadableImage,
    load_image,
    read_classes,
    source_of,
)
from trainkit.distributed import group
from trainkit.entry.build import (
    Rebuilt,
    inputs_of,
    model_inputs,
    read_split,
    rebuild,
    run_eval_transform,
)
from trainkit.entry.cli import split_args, usage_status
from trainkit.entry.errors import errors_as_one_line
from trainkit.loop.precision import Precision

USAGE = ("RUN_DIR inputs=FOLDER|test|train out=FILE.jsonl|FILE.pt [ckpt=best] [topk=5] "
         "[predict=pkg.module.function] [max_new_tokens=50] [key=value ...]")
OPTIONS = {"ckpt": "", "weights": "auto", "inputs": "", "out": "", "topk": "5",
           "predict": "", "max_new_tokens": "50"}

# What predict runs over: its inputs' names (paths or indices), a reader of one uint8 image by
# index (raises UnreadableImage), and what the model takes (mean/std, size, classes)
Source = tuple[list[Any], Callable[[int], torch.Tensor], Inputs]


def main(argv: list[str] | None = None) -> int:
    """Run ``trainkit predict``; return its exit status."""
    args = sys.argv[1:] if argv is None else list(argv)
    if (status := usage_status(args, "trainkit.predict", USAGE, __doc__)) is not None:
        return status
    with errors_as_one_line():
        run_dir, options, overrides = split_args(args, OPTIONS, USAGE)
        out = _check_out(options["out"])
        rows = predict_run(run_dir, options, overrides)
        if rows is not None:  # rank 0
            _write(out, rows)
            skipped = (f" ({len(rows['skipped'])} unreadable inputs skipped: "
                       "data.skip_corrupt=true)" if rows["skipped"] else "")
            print(f"wrote {len(rows['inputs'])} rows to {out}{skipped}")
    group.shutdown()
    return 0


def predict_run(run_dir: Path, options: dict[str, str], overrides: Sequence[str]
                ) -> dict[str, Any] | None:
    """The rows of every input, in input order, on rank 0 (None on the other ranks)."""
    run = rebuild(run_dir, options["ckpt"], options["weights"], overrides)
    runtime = Runtime.from_env(run.settings.trainer.device)
    use_device(runtime.device)
    group.init_process_group(runtime)
    own = run.cfg.get("dataset") is not None
    if source_of(run.settings.data.name, own_reader=own).takes == "text":  # texts in and out
        return _predict_text(run, options, runtime)
    names, read, inputs = _source(options["inputs"], run)
    model = Normalized(run.model, inputs).to(runtime.device).eval()
    precision = Precision(run.settings.trainer.precision, runtime.device)
    rows = _rows_of(options, inputs)
    mine = list(range(runtime.rank, len(names), runtime.world_size))  # this rank's share
    done: list[tuple[int, Any]] = []
    skipped: list[Any] = []
    batch = run.settings.data.eval_batch_size
    with torch.no_grad():
        for start in range(0, len(mine), batch):
            index, images = _readable(read, mine[start:start + batch], names, skipped,
                                      skip=run.settings.data.skip_corrupt)
            if not index:
                continue
            with precision.autocast():
                outputs = model(torch.stack(images).to(runtime.device)).float().cpu()
            done += zip(index, rows(outputs, [names[i] for i in index]))
    gathered = group.gather_to_main((done, skipped))
    if gathered is None:
        return None
    ordered = sorted((pair for part, _ in gathered for pair in part), key=lambda pair: pair[0])
    return {"inputs": [names[i] for i, _ in ordered], "rows": [row for _, row in ordered],
            "raw": options["out"].endswith(".pt"),
            "skipped": [name for _, part in gathered for name in part]}


def _readable(read: Callable[[int], torch.Tensor], index: list[int], names: list[Any],
              skipped: list[Any], *, skip: bool) -> tuple[list[int], list[torch.Tensor]]:
    """The inputs of ``index`` that decode, and their images. An unreadable one stops predict
    with one line, or with ``data.skip_corrupt=true`` gets no row: it is said and counted in
    ``skipped``, as training skips it."""
    kept, images = [], []
    for i in index:
        try:
            images.append(read(i))
        except UnreadableImage:
            if not skip:
                raise
            skipped.append(names[i])
            print(f"trainkit: skipped unreadable input {names[i]} (data.skip_corrupt=true; "
                  f"{len(skipped)} so far)", file=sys.stderr)
            continue
        kept.append(i)
    return kept, images


def _predict_text(run: Any, options: dict[str, str], runtime: Runtime) -> dict[str, Any] | None:
    """A Hugging Face text run's rows (:func:`trainkit.models.hf.classify` or ``generate``)
    over ``inputs=test|train`` (the run's split's texts) or a text file (one input a line)."""
    from trainkit.data.sources.hf_text import EVAL_SPLITS, load_tokenizer, read_splits
    from trainkit.models import hf

    data, spec = run.settings.data, options["inputs"]
    if options["out"].endswith(".pt"):
        raise TrainkitError(f"out={options['out']}: a text model's predictions are rows; give "
                            "a .jsonl file")
    if spec in ("test", "train"):
        splits = read_splits(data.root)
        name = spec if spec == "train" else next(s for s in EVAL_SPLITS if s in splits)
        texts = list(splits[name][data.text_column])
    elif Path(spec).is_file():
        texts = [line for line in Path(spec).read_text(encoding="utf-8").splitlines() if line]
    else:
        raise TrainkitError(f"inputs={spec}: give a text file (one input a line), or test or "
                            "train for a split of the run's data")
    try:
        topk, new_tokens = int(options["topk"]), int(options["max_new_tokens"])
    except ValueError:
        raise TrainkitError(f"topk={options['topk']}, max_new_tokens="
                            f"{options['max_new_tokens']}: give whole numbers") from None
    tokenizer, model = load_tokenizer(data.tokenizer), run.model.to(runtime.device).eval()
    classes = read_classes(run.state) or read_classes(run.run_dir)
    generating = run.cfg.model.get("task") == "causal_lm"
    mine = list(range(runtime.rank, len(texts), runtime.world_size))  # this rank's share
    done: list[tuple[int, Any]] = []
    for start in range(0, len(mine), data.eval_batch_size):
        index = mine[start:start + data.eval_batch_size]
        batch = [texts[i] for i in index]
        rows = (hf.generate(model, tokenizer, batch, seq_len=data.seq_len,
                            max_new_tokens=new_tokens) if generating
                else hf.classify(model, tokenizer, batch, seq_len=data.seq_len,
                                 classes=classes, topk=topk))
        done += zip(index, rows)
    gathered = group.gather_to_main(done)
    if gathered is None:
        return None
    ordered = sorted((pair for part in gathered for pair in part), key=lambda pair: pair[0])
    return {"inputs": [texts[i] for i, _ in ordered], "rows": [row for _, row in ordered],
            "raw": False, "skipped": []}  # a line of text is always readable


def _source(spec: str, run: Any) -> Source:
    """What to predict: its names (paths or indices), a reader of uint8 images by index, and
    the model's inputs (mean/std, size, classes) from the run's data."""
    if spec in ("test", "train"):
        return _split(run, train=spec == "train")
    folder = Path(spec)
    if not spec or not folder.is_dir():
        raise TrainkitError(f"inputs={spec}: give a folder of images, or test or train for a "
                            "split of the run's dataset")
    # in sorted order, subfolders too (an image folder's val/<class>/ as ImageFolder orders it)
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise TrainkitError(f"inputs={spec}: no images ({', '.join(IMAGE_SUFFIXES)}) in it")
    return _files(run, files)


def _files(run: Any, files: Sequence[Path]) -> Source:
    inputs, read = image_source(run)
    return [str(f) for f in files], lambda i: read(files[i]), inputs


def _split(run: Any, *, train: bool) -> Source:
    """A split of the run's data: an image folder's files (``test``: its validation files), a
    tensor dataset's images, or your own ``Dataset``'s samples, each by its index."""
    data = run.settings.data
    source = source_of(data.name, own_reader=run.cfg.get("dataset") is not None)
    if source.split_files is not None:  # the run's own split of its files
        files = source.split_files(data, run.settings.trainer.seed, train=train)
        return _files(run, [Path(f) for f in files])
    split = read_split(run.cfg, run.settings, train=train)
    if isinstance(split, TensorData):
        return list(range(len(split))), lambda i: split.images[i], inputs_of(split)
    inputs, transform, custom = run_eval_transform(run)
    samples = Samples(split, transform, channels=data.channels, image_column=data.image_column,
                      label_column=data.label_column, transform_all=custom)

    return list(range(len(split))), lambda i: samples.sample(i)[0], inputs


def image_source(run: Rebuilt) -> tuple[Inputs, Callable[[Path], torch.Tensor]]:
    """What the model takes (:func:`~trainkit.entry.build.model_inputs`), and a reader of an
    image file into it (uint8 ``[C, H, W]``): for a run on tensor data the file in that data's
    mode and size; for a run that decoded images, the run's own evaluation transform."""
    inputs = model_inputs(run)
    if not inputs.fused:  # tensor data: normalised as its in-memory loaders do
        return inputs, lambda path: read_image(path, inputs.image_size)
    _, transform, _ = run_eval_transform(run)
    channels = run.settings.data.channels
    return inputs, lambda path: transform(load_image(path, channels=channels))


def read_image(path: Path, size: Sequence[int]) -> torch.Tensor:
    """``path`` as uint8 ``[C, H, W]`` in a tensor dataset's mode (gray or RGB) and size."""
    from PIL import Image, UnidentifiedImageError
    from torchvision.transforms.v2 import functional

    try:
        with Image.open(path) as file:
            image = functional.pil_to_tensor(file.convert("L" if size[0] == 1 else "RGB"))
    except (UnidentifiedImageError, OSError) as err:
        why = ("not an image format Pillow reads" if isinstance(err, UnidentifiedImageError)
               else one_line(err, 60))  # the path last: a shortened line keeps its end
        raise UnreadableImage(f"cannot read an image file ({why}); replace or delete it, or "
                              f"set data.skip_corrupt=true to skip such files: {path}") from None
    if tuple(image.shape[-2:]) != tuple(size[-2:]):
        image = functional.resize(image, list(size[-2:]), antialias=True)
    return image


def _rows_of(options: dict[str, str], inputs: Inputs) -> Callable[[torch.Tensor, list], list]:
    """How a batch's outputs become rows: raw, the user's function, or top-k classes."""
    if options["out"].endswith(".pt"):
        return lambda outputs, names: list(outputs)
    if options["predict"]:
        from hydra.utils import get_method

        return get_method(options["predict"])
    try:
        k = min(int(options["topk"]), len(inputs.classes))
    except ValueError:
        raise TrainkitError(f"topk={options['topk']}: give a whole number") from None

    def top_classes(outputs: torch.Tensor, names: list) -> list[dict[str, Any]]:
        probs, index = outputs.softmax(-1).topk(k, dim=-1)
        return [{"input": name, "classes": [inputs.classes[i] for i in row.tolist()],
                 "probs": p.tolist()} for name, row, p in zip(names, index, probs)]

    return top_classes


def _check_out(out: str) -> Path:
    if not out.endswith((".jsonl", ".pt")):
        raise TrainkitError(f"out={out or '?'}: give a .jsonl file (rows of classes) or a .pt "
                            "file (raw outputs) to write")
    path = Path(out)
    if path.exists():
        raise TrainkitError(f"out={out} exists: remove it, or give another file")
    if not path.parent.is_dir():
        raise TrainkitError(f"out={out}: folder {path.parent} does not exist")
    return path


def _write(out: Path, rows: dict[str, Any]) -> None:
    """``out`` whole or not at all (written beside it, then renamed)."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    if rows["raw"]:
        outputs = torch.stack(rows["rows"]) if rows["rows"] else torch.empty(0)
        torch.save({"inputs": rows["inputs"], "outputs": outputs}, tmp)
    else:
        tmp.write_text("".join(json.dumps(row) + "\n" for row in rows["rows"]))
    tmp.replace(out)


if __name__ == "__main__":
    sys.exit(main())
