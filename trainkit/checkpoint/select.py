"""A finished run's checkpoint by name, and the model weights it holds.

``best``, ``last``, ``step_N`` or a path name a checkpoint of a run folder in either storage's
layout (``checkpoints/best.pt`` or the sharded ``checkpoints/best/``); a sharded one is read
whole in this process (:func:`~trainkit.checkpoint.consolidate.load_full`), so evaluating or
exporting an FSDP run needs neither torchrun nor a consolidate step first.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from trainkit.checkpoint.files import load_checkpoint
from trainkit.core.errors import TrainkitError

_STEP = re.compile(r"^step_(\d+)(\.pt)?$")
WEIGHTS = ("auto", "ema", "raw")


def find_checkpoint(run_dir: str | Path, ckpt: str | None = "best") -> Path:
    """The checkpoint ``ckpt`` names in ``run_dir``: ``best``, ``last``, ``step_N`` (as the log
    numbers steps) or a path (a ``.pt`` file or a sharded checkpoint directory); None: ``best``
    where the run kept one, else ``last`` (the commands' default when no ckpt is given).

    Raises:
        TrainkitError: the run has no checkpoints, or none by that name (the message lists
            those it has); ``best`` in a run that monitored no metric.
    """
    run_dir = Path(run_dir)
    if ckpt is None:
        ckpt = "best" if "best" in available(run_dir / "checkpoints") else "last"
    if ckpt not in ("best", "last") and not _STEP.match(ckpt):
        path = Path(ckpt)
        if not path.exists():
            raise TrainkitError(f"ckpt={ckpt}: no such file or folder; use best, last, step_N "
                                "or the path of a checkpoint")
        return path
    folder = run_dir / "checkpoints"
    if not run_dir.is_dir():
        raise TrainkitError(f"run folder {run_dir} does not exist: give the hydra.run.dir of a "
                            "finished run")
    have = available(folder)
    if not have:
        raise TrainkitError(f"{run_dir} has no checkpoints: train it first, or give another "
                            "run folder", details=[f"no last.pt or last/ in {folder}"])
    if ckpt in have:
        return have[ckpt]
    if ckpt == "best":
        raise TrainkitError("ckpt=best: this run kept no best checkpoint (it ran without "
                            "checkpoint.monitor): use ckpt=last or step_N, or train with "
                            "checkpoint.monitor=val/acc")
    steps = {int(m.group(1)): path for name, path in have.items() if (m := _STEP.match(name))}
    wanted = _STEP.match(ckpt)
    if wanted and int(wanted.group(1)) in steps:
        return steps[int(wanted.group(1))]
    raise TrainkitError(f"ckpt={ckpt}: {run_dir} has no such checkpoint; it has "
                        f"{', '.join(sorted(have, key=_order))}")


def available(folder: Path) -> dict[str, Path]:
    """``{"last": path, "best": path, "step_<N>": path}`` of a ``checkpoints`` folder (either
    layout; leftovers of unfinished saves, ``.*.tmp``, are not checkpoints)."""
    if not folder.is_dir():
        return {}
    found: dict[str, Path] = {}
    for path in folder.iterdir():
        name = path.name.removesuffix(".pt")
        if path.name.startswith("."):
            continue
        if name in ("best", "last") and path.exists():
            found[name] = path
        elif m := _STEP.match(path.name):
            found[f"step_{int(m.group(1))}"] = path
    return found


def _order(name: str) -> tuple[int, int]:
    m = _STEP.match(name)
    return (1, int(m.group(1))) if m else (0, 0)


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint at ``path`` on the CPU: a ``.pt`` file as it was saved, a sharded
    directory consolidated in this process."""
    path = Path(path)
    if path.is_dir():
        from trainkit.checkpoint.consolidate import load_full  # torch.distributed: only here

        state = load_full(path, key="ckpt")
    else:
        state = load_checkpoint(path, key="ckpt")
    state["_path"] = str(path)
    return state


def model_weights(state: Mapping[str, Any], weights: str = "auto"
                  ) -> tuple[dict[str, torch.Tensor], str]:
    """The model weights of a checkpoint and which they are (``"ema"`` or ``"raw"``).

    ``auto``: the EMA's when the run kept one (those its evaluations used), else the raw ones.

    Raises:
        TrainkitError: ``weights=ema`` for a run without an EMA, or an unknown choice.
    """
    if weights not in WEIGHTS:
        raise TrainkitError(f"weights={weights}: use one of {', '.join(WEIGHTS)}")
    ema = (state.get("ema") or {}).get("weights")
    if weights == "ema" and ema is None:
        raise TrainkitError("weights=ema: this run kept no EMA (trainer.ema_decay was null); "
                            "use weights=raw")
    if ema is not None and weights != "raw":
        return dict(ema), "ema"
    return dict(state["model"]), "raw"
