"""A finished run's checkpoint by name, and the model weights it holds.

``best``, ``last``, ``step_N`` or a path name a checkpoint of a run, wherever the run kept them:
its recorded ``checkpoint.dir`` (another folder, or a store's URL: commit records) or its own
``checkpoints/``, in either format (``best.pt`` or the sharded ``best/``). A sharded one is read
whole in this process (:func:`~trainkit.checkpoint.consolidate.load_full`), so evaluating or
exporting an FSDP run needs neither torchrun nor a consolidate step first. These readers sit
beside the writers and import them; no writer imports a reader.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from trainkit.checkpoint.location import (
    Folder,
    LocalFolder,
    checkpoint_folder,
    checkpoint_path,
    is_sharded_checkpoint,
    read_file,
)
from trainkit.core.errors import TrainkitError, one_line
from trainkit.core.location import recorded_dir
from trainkit.core.objectstore import store_error

_STEP = re.compile(r"^step_(\d+)(\.pt|\.json)?$")
WEIGHTS = ("auto", "ema", "raw")


def find_checkpoint(run_dir: str | Path, ckpt: str | None = "best") -> Path | str:
    """The checkpoint ``ckpt`` names in ``run_dir``: ``best``, ``last``, ``step_N`` (as the log
    numbers steps) or a path (a ``.pt`` file, a sharded checkpoint directory, or a commit
    record's URL); None: ``best`` where the run kept one, else ``last`` (the commands' default
    when no ckpt is given). The run's checkpoints are looked for where it wrote them
    (:func:`checkpoints_of`). A checkpoint in a store is named by its record's URL (a string).

    Raises:
        TrainkitError: the run has no checkpoints, or none by that name (the message lists
            those it has); ``best`` in a run that monitored no metric.
    """
    run_dir = Path(run_dir)
    if ckpt is not None and ckpt not in ("best", "last") and not _STEP.match(ckpt):
        path = checkpoint_path(ckpt)
        if isinstance(path, Path) and not path.exists():
            raise TrainkitError(f"ckpt={ckpt}: no such file or folder; use best, last, step_N "
                                "or the path of a checkpoint")
        return path  # a record's URL: reading it says whether it is there
    if not run_dir.is_dir():
        raise TrainkitError(f"run folder {run_dir} does not exist: give the hydra.run.dir of a "
                            "finished run")
    where = checkpoints_of(run_dir)
    have = _listed(where)
    if ckpt is None:
        ckpt = "best" if "best" in have else "last"
    if not have:
        raise TrainkitError(f"{run_dir} has no checkpoints: train it first, or give another "
                            "run folder", details=[f"no last.pt, last/ or last.json in {where}"])
    if ckpt in have:
        return have[ckpt]
    if ckpt == "best":
        raise TrainkitError("ckpt=best: this run kept no best checkpoint (it ran without "
                            "checkpoint.monitor): use ckpt=last or step_N, or train with "
                            "checkpoint.monitor=val/acc")
    wanted = _STEP.match(ckpt)
    if wanted and f"step_{int(wanted.group(1))}" in have:
        return have[f"step_{int(wanted.group(1))}"]
    raise TrainkitError(f"ckpt={ckpt}: {run_dir} has no such checkpoint; it has "
                        f"{', '.join(sorted(have, key=_order))}")


def checkpoints_of(run_dir: str | Path) -> Folder:
    """Where a run wrote its checkpoints: the ``checkpoint.dir`` its config records (a folder or
    a store's URL), else ``<run_dir>/checkpoints`` where it holds any (a run folder copied or
    moved reads its own files, not the ones its summary names at the old place), else the
    folder its summary's best checkpoint lies in (a library run's own ``checkpoint.dir``)."""
    run_dir = Path(run_dir)
    if configured := recorded_dir(run_dir):
        return checkpoint_folder(configured)
    own = LocalFolder(run_dir / "checkpoints")
    if _listed(own):
        return own
    if best := _summary_best(run_dir):  # best.pt, best/ or best.json: its folder
        folder = checkpoint_path(best.rstrip("/").rsplit("/", 1)[0])
        if isinstance(folder, str) or (folder.is_absolute() and folder.is_dir()):
            return checkpoint_folder(folder)
    return LocalFolder(run_dir / "checkpoints")


def _summary_best(run_dir: Path) -> str | None:
    """``summary.json``'s ``best.path`` (a library run records no config, but its summary)."""
    try:
        best = json.loads((run_dir / "summary.json").read_text()).get("best") or {}
    except (OSError, ValueError, AttributeError):
        return None
    path = best.get("path") if isinstance(best, dict) else None
    return str(path) if path else None


def _listed(where: Folder) -> dict[str, Path | str]:
    """:meth:`available` of ``where``, a store that cannot be reached said in one line."""
    try:
        return where.available()
    except TrainkitError:
        raise
    except Exception as err:
        raise (store_error(err, str(where), "checkpoint.dir") or TrainkitError(
            f"cannot list the checkpoints in {where} ({one_line(err, 80)})")) from None


def available(folder: Path) -> dict[str, Path | str]:
    """``{"last": path, "best": path, "step_<N>": path}`` of a ``checkpoints`` folder (either
    format; leftovers of unfinished saves, ``.*.tmp``, are not checkpoints)."""
    return LocalFolder(Path(folder)).available()


def _order(name: str) -> tuple[int, int]:
    m = _STEP.match(name)
    return (1, int(m.group(1))) if m else (0, 0)


def checkpoint_name(path: Path | str, ckpt: str | None) -> str:
    """The name a checkpoint goes by in the commands' files (``eval_<name>.json``): ``ckpt`` as
    the user gave it (best, last, step_N), else the file's (``step_000000008.pt`` -> step_8)."""
    if ckpt and (ckpt in ("best", "last") or _STEP.match(ckpt)) and str(path) != ckpt:
        name = ckpt
    else:
        name = re.sub(r"\.(pt|json)$", "", str(path).rstrip("/").rsplit("/", 1)[-1])
    return re.sub(r"^step_0+(?=\d)", "step_", name)


def read_whole(path: str | Path) -> dict[str, Any]:
    """The checkpoint at ``path`` whole on the CPU, ``_path`` set: a ``.pt`` file as it was
    saved, a sharded directory consolidated in this process, a commit record's URL (either
    format) read from its store."""
    path = checkpoint_path(path) if isinstance(path, str) else path
    if is_sharded_checkpoint(path):
        from trainkit.checkpoint.consolidate import load_full  # torch.distributed: only here

        state = load_full(path, key="ckpt")
    else:
        state = read_file(path, "ckpt")
    state["_path"] = str(path)
    return state


def model_weights(state: Mapping[str, Any], weights: str = "auto", model_name: str | None = None
                  ) -> tuple[dict[str, torch.Tensor], str]:
    """The model weights of a checkpoint and which they are (``"ema"`` or ``"raw"``).

    ``auto``: the EMA's when the run kept one (those its evaluations used), else the raw ones.
    ``model_name``: one model of a fit of several (the checkpoint's ``models``) by name; None
    (or the first name) is the first model, the ``model`` key, whose EMA it is.

    Raises:
        TrainkitError: ``weights=ema`` for a run without an EMA (or for another than the first
            model), an unknown choice, or a ``model_name`` the checkpoint does not hold.
    """
    if weights not in WEIGHTS:
        raise TrainkitError(f"weights={weights}: use one of {', '.join(WEIGHTS)}")
    names = list(state.get("models") or {})
    if model_name is not None and model_name != (names[0] if names else None):
        if model_name not in names:
            held = (f"its models are {', '.join(names)}" if names else
                    "it holds one model (a fit of one): leave model_name out")
            raise TrainkitError(f"model_name={model_name}: no such model in this checkpoint; "
                                f"{held}")
        if weights == "ema":
            raise TrainkitError(f"weights=ema: the EMA is the first model's ({names[0]}); use "
                                f"weights=raw for model_name={model_name}")
        return dict(state["models"][model_name]), "raw"
    ema = (state.get("ema") or {}).get("weights")
    if weights == "ema" and ema is None:
        raise TrainkitError("weights=ema: this run kept no EMA (trainer.ema_decay was null); "
                            "use weights=raw")
    if ema is not None and weights != "raw":
        return dict(ema), "ema"
    return dict(state["model"]), "raw"
