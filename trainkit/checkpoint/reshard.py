"""Reading sharded checkpoints into a sharded or a plain model, on any number of ranks (whole
into one process: :mod:`trainkit.checkpoint.consolidate`).

DCP reshards on load: each rank asks for the parts of each tensor its own shards cover, by
parameter name, so a directory written by 4 ranks loads onto 2, onto 1 sharded process, or
into a plain model. What cannot be resharded -- where the data loader is and each rank's random
streams -- carries over by the rule of :func:`carry_over` (docs/distributed.md).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainkit.checkpoint.contents import check_weights_fit
from trainkit.checkpoint.sharded import _quiet_single_process

# torch.distributed.checkpoint is imported where used: with FSDP and sympy it costs ~0.8 s,
# which a run without sharded checkpoints should not pay at start-up.
from trainkit.core import rng
from trainkit.core.errors import TrainkitError, one_line

log = logging.getLogger("trainkit")


def tensor_state(model: nn.Module, optimizer: Any, ema: Any) -> dict[str, Any]:
    """What DCP writes, and loads in place: the model's and optimizer's state keyed by
    parameter name (DTensor shards under FSDP, plain tensors otherwise), and the EMA weights."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    if ema is not None:
        state["ema"] = ema.state_dict()["weights"]  # the shadow tensors themselves
    return state


def load_tensors(meta: Mapping[str, Any], model: nn.Module, optimizer: Any, ema: Any,
                 group: Any = None, *, key: str = "checkpoint.resume") -> bool:
    """Load a directory's model, optimizer and EMA weights (as :func:`read_meta` found it).

    Returns whether EMA weights were loaded (a checkpoint of a run without EMA has none).

    Raises:
        TrainkitError: the checkpoint does not fit this model or optimizer.
    """
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path, saved = meta["_path"], meta["_tensors"]
    state = tensor_state(model, optimizer, ema)
    _check_fits(path, state["model"], saved, key)
    if ema is not None and not any(name.startswith("ema.") for name in saved):
        del state["ema"]
    _load(meta.get("_files", path), state, group)  # a URL's: its local copy
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    return "ema" in state


def load_weights(meta: Mapping[str, Any], model: nn.Module, ema: Any) -> bool:
    """Only the model's (and the EMA's) weights from a directory (``checkpoint.init_from``);
    returns whether EMA weights were loaded."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    _check_fits(meta["_path"], state["model"], meta["_tensors"], "checkpoint.init_from")
    if ema is not None and any(name.startswith("ema.") for name in meta["_tensors"]):
        state["ema"] = ema.state_dict()["weights"]
    _load(meta.get("_files", meta["_path"]), state, None)
    set_model_state_dict(model, state["model"])
    return "ema" in state


def _load(path: str, state: dict[str, Any], group: Any) -> None:
    """DCP's load in place, its error as one line."""
    import torch.distributed.checkpoint as dcp

    single = not (dist.is_available() and dist.is_initialized())
    try:
        with _quiet_single_process():
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), process_group=group,
                     no_dist=single)
    except dcp.CheckpointException as err:
        raise TrainkitError(f"checkpoint {path} does not fit this run's model or optimizer "
                            f"({one_line(err, 100)})") from None


def load_full_weights(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Full (unsharded) weights, a ``.pt`` file's, into a sharded model: each rank keeps its
    shard of them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, dict(weights), options=StateDictOptions(full_state_dict=True))


def _check_fits(path: str, here: Mapping[str, Any], saved: Mapping[str, Any], key: str) -> None:
    """The same one-line error as for a ``.pt`` file of another model (DCP's metadata gives
    the saved shapes)."""
    shapes = {name[len("model."):]: SimpleNamespace(shape=torch.Size(getattr(md, "size", ())))
              for name, md in saved.items() if name.startswith("model.")}
    check_weights_fit(here, shapes, key=key, path=path)


def carry_over(meta: Mapping[str, Any], state: Any, *, rank: int, world_size: int,
               batch_size: int | None, batches_per_epoch: int | None) -> str:
    """Restore the RNG and fix the data position for this world size; words for the log line.

    Same world size: each rank's own RNG state, the exact position. Another: the same global
    sample position of the epoch (the ranks' shards interleave one permutation), rounded down to a
    whole batch of the new world size, and each rank's generators reseeded from its seed and step.
    """
    saved = int(meta.get("world_size") or 1)
    if saved == world_size:
        rng.set_rng_state(rng.rng_of_rank(meta, rank))
        return ""
    old_batch = meta.get("batch_size") or batch_size or 1
    samples = state.batch_in_epoch * saved * old_batch  # of this epoch, over all ranks
    batch = samples // (world_size * (batch_size or old_batch))
    if batches_per_epoch and batch >= batches_per_epoch:
        state.epoch, batch = state.epoch + 1, 0
    state.batch_in_epoch = batch
    rng.seed_everything(rng.mix_seed(torch.initial_seed(), state.global_step))
    return (f"; saved on {saved} ranks, now {world_size}: the data resumes at sample "
            f"{samples} of the epoch (batch {batch}) and each rank's RNG is reseeded from "
            "its seed and the step")
