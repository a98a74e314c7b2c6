"""``trainkit export RUN_DIR [ckpt=best] [--format safetensors|pt|pt2] [--dtype fp32|bf16|fp16]
[--weights auto|ema|raw] [--out DIR] [key=value ...]``.

Writes a run's model weights -- the EMA's when the run kept one -- as a new folder (default
``RUN_DIR/export_<ckpt>``) of one weights file and ``model.json`` (the model's ``_target_`` and
arguments, class names, mean/std, image size, the run's manifest). A sharded (FSDP) checkpoint is
consolidated on the way, in this process. ``pt2`` is a ``torch.export`` program with the input
normalisation inside: it loads with torch alone (``torch.export.load``). The data is read for
its facts (mean/std, image size, classes): ``data.root=...`` where it moved. Exit status: 0 when
written, 2 on bad input (nothing written, an existing folder left as it is). Without ckpt=: ``best``
where the run kept one, else ``last``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omegaconf import OmegaConf

from trainkit.checkpoint.contents import trainkit_version
from trainkit.checkpoint.export import DTYPES, FORMATS, export
from trainkit.checkpoint.select import WEIGHTS
from trainkit.core.errors import TrainkitError, command_name
from trainkit.entry.errors import errors_as_one_line
from trainkit.entry.rebuild import image_source, rebuild, split_args
from trainkit.models.pretrained import model_node

USAGE = "RUN_DIR [ckpt=best|last|step_N|PATH] [--format F] [--dtype D] [--weights W] [--out DIR]"


def main(argv: list[str] | None = None) -> int:
    """Run ``trainkit export``; return its exit status."""
    parser = argparse.ArgumentParser(prog=command_name("trainkit.export"), usage=f"%(prog)s "
                                     f"{USAGE}", description=__doc__.split("\n\n")[1])
    parser.add_argument("--format", default="safetensors", choices=FORMATS)
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    parser.add_argument("--weights", default="auto", choices=WEIGHTS,
                        help="auto: the EMA's when the run kept one")
    parser.add_argument("--out", type=Path, help="the folder to write (must not exist)")
    parser.add_argument("args", nargs="*", help="RUN_DIR, ckpt=..., config overrides")
    args = parser.parse_intermixed_args(argv)
    with errors_as_one_line():
        out = export_run(args.args, fmt=args.format, dtype=args.dtype, weights=args.weights,
                         out=args.out)
        print(f"wrote {out}")
    return 0


def export_run(args: list[str], *, fmt: str = "safetensors", dtype: str = "fp32",
               weights: str = "auto", out: Path | None = None) -> Path:
    """Export the run ``args`` names (``RUN_DIR [ckpt=...] [overrides]``); return the folder."""
    run_dir, options, overrides = split_args(args, {"ckpt": ""}, USAGE)
    if out is not None and out.exists():  # before the slow part; export() checks again
        raise TrainkitError(f"export folder {out} exists: remove it, or give another --out")
    run = rebuild(run_dir, options["ckpt"], weights, overrides)
    out = out if out is not None else run_dir / f"export_{run.name}"
    inputs, _ = image_source(run)  # mean/std, image size, classes
    info = {"model": model_node(OmegaConf.to_container(run.cfg.model, resolve=True)),
            "weights": run.weights,
            "checkpoint": {"ckpt": run.name, "path": run.state["_path"], "step": run.step},
            "manifest": run.state.get("manifest"), "exported_by": f"trainkit {trainkit_version()}"}
    return export(run.model, out, fmt=fmt, dtype=dtype, inputs=inputs, info=info)


if __name__ == "__main__":
    sys.exit(main())
