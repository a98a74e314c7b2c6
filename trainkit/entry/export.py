"""``trainkit export RUN_DIR [ckpt=best] [--format safetensors|pt|pt2] [--dtype fp32|bf16|fp16]
[--weights auto|ema|raw] [--out DIR] [key=value ...]``.

Writes a run's model weights -- the EMA's when the run kept one -- as a new folder (default
``RUN_DIR/export_<ckpt>``) of one weights file and ``model.json`` (the model's ``_target_`` and
arguments, class names, mean/std, image size, the run's manifest). A sharded (FSDP) checkpoint is
consolidated on the way, in this process. ``pt2`` is a ``torch.export`` program with the input
normalisation inside: it loads with torch alone (``torch.export.load``). The input's facts
(mean/std, image size, classes) are those the run recorded when it trained
(``RUN_DIR/inputs.json``): neither its data nor its ``dataset._target_``'s module is needed; a run
from before that record reads its data for them (``data.root=...`` where it moved). Exit status:
0 when written, 2 on bad input (nothing written, an existing folder left as it is). Without
ckpt=: ``best`` where the run kept one, else ``last``.

A Hugging Face text model's run (``model=hf``) exports its LoRA adapters merged into the weights,
with its tokenizer (:mod:`trainkit.checkpoint.text_export`); ``--adapters`` writes a LoRA run's
adapters alone in PEFT's format (default folder ``RUN_DIR/export_<ckpt>_adapters``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omegaconf import OmegaConf

from trainkit.checkpoint.contents import trainkit_version
from trainkit.checkpoint.export import DTYPES, FORMATS, export
from trainkit.checkpoint.select import WEIGHTS
from trainkit.checkpoint.text_export import export_adapters, export_text
from trainkit.core.errors import TrainkitError, command_name, help_text
from trainkit.data import source_of
from trainkit.data.sources.hf_text import load_tokenizer
from trainkit.entry.build import Rebuilt, model_inputs, rebuild, run_classes
from trainkit.entry.cli import split_args
from trainkit.entry.errors import errors_as_one_line
from trainkit.models.build import with_drop_path_argument

USAGE = ("RUN_DIR [ckpt=best|last|step_N|PATH] [--format F] [--dtype D] [--weights W] "
         "[--out DIR] [--adapters]")


def main(argv: list[str] | None = None) -> int:
    """Run ``trainkit export``; return its exit status."""
    parser = argparse.ArgumentParser(prog=command_name("trainkit.export"), usage=f"%(prog)s "
                                     f"{USAGE}", description=help_text(__doc__.split("\n\n")[1]))
    parser.add_argument("--format", default="safetensors", choices=FORMATS)
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    parser.add_argument("--weights", default="auto", choices=WEIGHTS,
                        help="auto: the EMA's when the run kept one")
    parser.add_argument("--out", type=Path, help="the folder to write (must not exist)")
    parser.add_argument("--adapters", action="store_true",
                        help="a LoRA run: its adapters alone, in PEFT's format")
    parser.add_argument("args", nargs="*", help="RUN_DIR, ckpt=..., config overrides")
    args = parser.parse_intermixed_args(argv)
    with errors_as_one_line():
        out = export_run(args.args, fmt=args.format, dtype=args.dtype, weights=args.weights,
                         out=args.out, adapters=args.adapters)
        print(f"wrote {out}")
    return 0


def export_run(args: list[str], *, fmt: str = "safetensors", dtype: str = "fp32",
               weights: str = "auto", out: Path | None = None, adapters: bool = False) -> Path:
    """Export the run ``args`` names (``RUN_DIR [ckpt=...] [overrides]``); return the folder."""
    run_dir, options, overrides = split_args(args, {"ckpt": ""}, USAGE)
    if out is not None and out.exists():  # before the slow part; export() checks again
        raise TrainkitError(f"export folder {out} exists: remove it, or give another --out")
    run = rebuild(run_dir, options["ckpt"], weights, overrides)
    out = out if out is not None else run_dir / f"export_{run.name}{'_adapters' * adapters}"
    own = run.cfg.get("dataset") is not None
    text = source_of(run.settings.data.name, own_reader=own).takes == "text"
    if adapters or text:  # a Hugging Face model, or adapters
        return export_text_run(run, out, fmt=fmt, dtype=dtype, adapters=adapters)
    inputs = model_inputs(run)  # mean/std, image size, classes: as the run recorded
    node = OmegaConf.to_container(run.cfg.model, resolve=True)
    node.pop("pretrained", None)  # where the run's weights started: the export's are its own
    node = with_drop_path_argument(node)  # model.drop_path: as the model's own argument
    info = {"model": node,
            "weights": run.weights,
            "checkpoint": {"ckpt": run.name, "path": run.state["_path"], "step": run.step},
            "manifest": run.state.get("manifest"), "exported_by": f"trainkit {trainkit_version()}"}
    return export(run.model, out, fmt=fmt, dtype=dtype, inputs=inputs, info=info)


def export_text_run(run: Rebuilt, out: Path, *, fmt: str, dtype: str, adapters: bool) -> Path:
    """A text model's export (:mod:`trainkit.checkpoint.text_export`): merged, with its
    tokenizer, or (``adapters``) its LoRA adapters alone."""
    data = run.settings.data
    text = source_of(data.name, own_reader=run.cfg.get("dataset") is not None).takes == "text"
    tokenizer = load_tokenizer(data.tokenizer) if text else None
    if adapters:
        return export_adapters(run.model, out, tokenizer=tokenizer)
    node = OmegaConf.to_container(run.cfg.model, resolve=True)
    node.pop("lora", None)  # merged: the plain model
    classes = run_classes(run)
    info = {"model": node, "weights": run.weights,
            "checkpoint": {"ckpt": run.name, "path": run.state["_path"], "step": run.step},
            "classes": classes, "num_classes": len(classes) if classes else None,
            "seq_len": data.seq_len, "manifest": run.state.get("manifest"),
            "exported_by": f"trainkit {trainkit_version()}"}
    return export_text(run.model, out, fmt=fmt, dtype=dtype, tokenizer=tokenizer,
                       seq_len=data.seq_len, info=info)


if __name__ == "__main__":
    sys.exit(main())
