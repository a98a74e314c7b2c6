"""What a run reports when it ends: ``summary.json`` and TensorBoard's hparams."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from trainkit.config import flatten


class Begun(NamedTuple):
    """Where this process's share of a run began: rates count only its own work."""

    started: float  # time.perf_counter()
    samples: int
    step: int


def build_summary(status: str, results: Mapping[str, float], counters: Mapping[str, Any],
                  begun: Begun, *, world_size: int, peak_memory: Mapping[str, float],
                  startup_s: float | None = None, setup_s: float | None = None,
                  **extra: Any) -> dict[str, Any]:
    """The contents of ``summary.json`` (see the README's run-directory section).

    ``counters``: the loop state's ``state_dict()`` (``global_step``, ``samples_seen``, ...) and
    its ``epoch_number``. ``startup_s``: seconds from the process's start to its first training
    step, for the first fit of a process run from a file or module only (None otherwise, and
    when training never began); ``setup_s``: the fit's own, from its call to its first step.
    """
    wall = time.perf_counter() - begun.started
    return {
        "status": status,
        "metrics": dict(results),
        "global_step": counters["global_step"],
        # the last step's epoch counted from 1, as train.log names it: the epochs completed
        # when the run ended at an epoch's end, the epoch it stopped in otherwise
        "epoch": counters["epoch_number"],
        "skipped_steps": counters["skipped_steps"],
        "nonfinite_steps": counters["nonfinite_steps"],
        "wall_time_s": wall,
        # this process's own work: a resumed run does not count what came before (and the
        # wall time includes evaluation and checkpointing)
        "samples_per_s": ((counters["samples_seen"] - begun.samples) * world_size / wall
                          if wall else 0.0),
        "steps_per_s": (counters["global_step"] - begun.step) / wall if wall else 0.0,
        "startup_s": startup_s,
        "setup_s": setup_s,
        "world_size": world_size,
        "peak_memory": dict(peak_memory),
        # trainer.micro_batch_size's samples per micro-batch (auto's, as found); absent: off
        **({"micro_batch_size": counters["micro_batch_size"]}
           if counters.get("micro_batch_size") else {}),
        # trainer.spike's rollbacks (each one's step, loss, batches skipped); absent: off
        **({"spike_rollbacks": len(counters["spike"]["rollbacks"]),
            "spike_skipped_batches": sum(r["batches"] for r in counters["spike"]["rollbacks"])}
           if counters.get("spike") is not None else {}),
        **extra,
    }


def write_hparams(run_dir: Path | None, config: Mapping[str, Any],
                   results: Mapping[str, float]) -> None:
    """The run's settings with its final metrics, for TensorBoard's HPARAMS tab (tb/hparams)."""
    if run_dir is None:
        return
    from torch.utils.tensorboard import SummaryWriter

    flat = {key: value if isinstance(value, (int, float, str, bool)) else str(value)
            for key, value in flatten(config).items()}
    with SummaryWriter(log_dir=str(run_dir / "tb" / "hparams")) as writer:
        writer.add_hparams(flat, {f"hparam/{k}": v for k, v in results.items()}, run_name=".")


def write_summary(run_dir: str | Path, summary: Mapping[str, Any]) -> None:
    """``<run_dir>/summary.json``, replaced atomically: readers never see half a file."""
    path = Path(run_dir) / "summary.json"
    tmp = path.with_name(".summary.json.tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(path)


def read_summary(run_dir: str | Path | None) -> dict[str, Any] | None:
    """``<run_dir>/summary.json`` as written, or None where there is none (or it is unreadable)."""
    path = Path(run_dir) / "summary.json" if run_dir is not None else None
    try:
        return json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None
