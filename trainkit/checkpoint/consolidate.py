"""A sharded checkpoint whole in one process: ``python -m trainkit.checkpoint consolidate`` and
``verify_resume`` read directories through it, without a process group."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from trainkit.checkpoint import remote_sharded
from trainkit.checkpoint.files import save_atomic
from trainkit.checkpoint.location import checkpoint_path, read_shards
from trainkit.checkpoint.sharded import _quiet_single_process
from trainkit.core.errors import TrainkitError, one_line


def load_full(path: str | Path, *, key: str = "checkpoint") -> dict[str, Any]:
    """A whole sharded checkpoint in this process (no process group): ``trainkit.pt``'s state
    with ``model``, ``optimizer`` and ``ema["weights"]`` filled in as plain tensors. ``path``
    may be a commit record's URL (:mod:`~trainkit.checkpoint.remote_sharded`)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    meta = read_shards(checkpoint_path(path), key)
    fd, raw = tempfile.mkstemp(prefix=".consolidate-", suffix=".tmp")
    os.close(fd)
    try:
        with _quiet_single_process():
            dcp_to_torch_save(meta.get("_files", path), raw)
        tensors = torch.load(raw, map_location="cpu", weights_only=True)
    except Exception as err:
        raise TrainkitError(f"checkpoint {path} cannot be read ({one_line(err, 80)})") from None
    finally:
        os.unlink(raw)
        remote_sharded.forget(meta)
    meta.pop("_files", None)
    meta.pop("_tensors")
    meta["model"], meta["optimizer"] = tensors["model"], tensors["optimizer"]
    if meta.get("ema") is not None and "ema" in tensors:
        meta["ema"] = {**meta["ema"], "weights": tensors["ema"]}
    return meta


def consolidate(src: str | Path, out: str | Path, *, optimizer: bool = False) -> Path:
    """Write a sharded checkpoint as one plain file: ``model`` (the unwrapped model's
    state_dict), ``global_step``, ``epoch``, and with ``optimizer`` the optimizer's state.

    The file loads with ``weights_only=True`` and its ``model`` with ``strict=True``. ``src`` may be
    a commit record's URL (``s3://bucket/run/last.json``); an incomplete one writes nothing.

    Raises:
        TrainkitError: ``src`` is missing, incomplete or not a checkpoint; ``out`` is not writable.
    """
    out = Path(out)
    if not out.parent.is_dir():
        raise TrainkitError(f"cannot write {out}: folder {out.parent} does not exist")
    if out.is_dir():
        raise TrainkitError(f"{out} is a folder: give the file to write, e.g. {out}/model.pt")
    if isinstance(where := checkpoint_path(src), Path):  # not a record in a store
        _check_sharded_source(where)
    full = load_full(src, key="consolidate's source")
    plain = {"model": full["model"], "global_step": full["global_step"], "epoch": full["epoch"]}
    if optimizer:
        plain["optimizer"] = full["optimizer"]
    try:
        return save_atomic(plain, out)
    except OSError as err:
        raise TrainkitError(f"cannot write {out} ({err.strerror or one_line(err, 60)})") from None


def _check_sharded_source(src: Path) -> None:
    """Refuse, in words that say what it is, a source that is no checkpoint directory: a run
    whose checkpoints are single files (nothing to consolidate), or a run folder."""
    if src.is_file():
        raise TrainkitError(f"{src} is a single-file checkpoint already: nothing needs "
                            "consolidating; torch.load(path, weights_only=True) loads it")
    for folder in (src / "checkpoints", src):
        if (folder / "last.pt").is_file() and not (folder / "last").exists():
            raise TrainkitError(
                f"this run's checkpoints are single files already (newest: {folder / 'last.pt'})"
                ": nothing needs consolidating; torch.load(path, weights_only=True) loads one")
    if (src / "checkpoints" / "last").exists():
        raise TrainkitError(f"{src} is a run folder: give one of its checkpoints, e.g. "
                            f"{src / 'checkpoints' / 'last'}")
