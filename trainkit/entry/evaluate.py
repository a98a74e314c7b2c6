"""``trainkit evaluate RUN_DIR [ckpt=best|last|step_N|PATH] [weights=auto|ema|raw] [key=value]``.

Evaluates a finished run's checkpoint (default: ``best`` where the run kept one, else ``last``) on
its validation data with its own metrics: the model and the data are rebuilt from the config the
checkpoint stores, changed by the ``key=value`` overrides (``data.root=/other/copy``,
``data.eval_batch_size=500``, ``trainer.device=cpu``). The EMA's weights are used when the run kept
an EMA, as its own evaluations did (``weights=raw``: the others), so evaluating ``best`` gives the
value the run recorded for that step. Prints one line and writes ``RUN_DIR/eval_<ckpt>.json``
(``eval_<ckpt>_raw.json`` with ``weights=raw``). Works on a sharded (FSDP) run in one process, and
under torchrun (``torchrun --nproc-per-node=2 --no-python trainkit evaluate RUN_DIR``), each rank
evaluating its share. Exit status: 0 when evaluated, 2 on bad input (nothing written).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from trainkit.core.cuda_settings import use_device
from trainkit.core.runtime import Runtime
from trainkit.distributed import group
from trainkit.entry.build import (
    build_criterion,
    build_data,
    build_forward,
    build_metrics,
    on_device,
    rebuild,
)
from trainkit.entry.cli import split_args, usage_status
from trainkit.entry.errors import errors_as_one_line
from trainkit.loop import evaluation
from trainkit.loop.precision import Precision

USAGE = ("RUN_DIR [ckpt=best|last|step_N|PATH] [weights=auto|ema|raw] [key=value ...]")
OPTIONS = {"ckpt": "", "weights": "auto"}


def main(argv: list[str] | None = None) -> int:
    """Run ``trainkit evaluate``; return its exit status."""
    args = sys.argv[1:] if argv is None else list(argv)
    if (status := usage_status(args, "trainkit.entry.evaluate", USAGE, __doc__)) is not None:
        return status
    with errors_as_one_line():
        run_dir, options, overrides = split_args(args, OPTIONS, USAGE)
        record = evaluate_run(run_dir, options["ckpt"], options["weights"], overrides)
        if record is not None:  # rank 0
            shown = " ".join(f"{k} {v:.4f}" for k, v in record["metrics"].items())
            print(f"{record['ckpt']} (step {record['step']}, {record['weights']} weights): "
                  f"{shown}; {record['file']}")
    group.shutdown()
    return 0


def evaluate_run(run_dir: Path, ckpt: str = "best", weights: str = "auto",
                 overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any] | None:
    """Evaluate checkpoint ``ckpt`` of ``run_dir`` and write ``eval_<ckpt>.json`` there; return
    what it holds (on rank 0; None on the other ranks)."""
    run = rebuild(run_dir, ckpt, weights, overrides)
    runtime = Runtime.from_env(run.settings.trainer.device)
    use_device(runtime.device)
    group.init_process_group(runtime)  # under torchrun: each rank evaluates its share
    _, val_data, num_classes = build_data(run.cfg, run.settings, runtime)
    metrics = {name: metric.to(runtime.device)
               for name, metric in build_metrics(run.cfg, num_classes).items()}
    results = evaluation.evaluate(
        on_device(run.model, run.settings, runtime.device), val_data,
        precision=Precision(run.settings.trainer.precision, runtime.device),
        device=runtime.device, criterion=build_criterion(run.cfg), metrics=metrics,
        forward=build_forward(run.cfg), max_batches=run.settings.trainer.eval_max_batches)
    if not runtime.is_main:
        return None
    # weights=ema|raw named: a file of its own beside the run's usual one, eval_<ckpt>.json
    file = Path(run_dir) / (f"eval_{run.name}.json" if weights == "auto"
                            else f"eval_{run.name}_{weights}.json")
    record = {"ckpt": run.name, "checkpoint": run.state["_path"], "step": run.step,
              "weights": run.weights, "metrics": results, "overrides": list(overrides),
              "world_size": runtime.world_size, "file": str(file)}
    tmp = file.with_name(f".{file.name}.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(file)  # readers never see half a file
    return record


if __name__ == "__main__":
    sys.exit(main())
