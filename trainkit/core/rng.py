"""Seeding and the RNG state that checkpoints carry, so a resumed run draws the same numbers."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

_MASK64 = (1 << 64) - 1


def mix_seed(*keys: int) -> int:
    """One 63-bit seed from several integers (splitmix64): nearby keys, unrelated seeds."""
    h = 0x9E3779B97F4A7C15
    for key in keys:
        h = (h ^ (key & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 29
    return h >> 1  # torch.Generator.manual_seed takes up to 2**63 - 1 without wrapping


def seed_everything(seed: int, *, accelerators: bool = True) -> None:
    """Seed Python's, NumPy's and torch's (CPU and every CUDA device) generators.

    ``accelerators=False`` seeds torch's CPU generator only: ``torch.manual_seed`` also queues
    a seed for each accelerator backend not started yet (recording the caller's stack), which
    a run on the CPU draws nothing from.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    if accelerators:
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


def seed_rank(rank: int, seed: int | None = None, *,
              device: torch.device | None = None) -> None:
    """Give this rank its own random stream, derived from ``seed`` (default: the seed in use)
    and the rank; on a CPU ``device``, the CPU's generators only.

    Every rank of a DDP job seeds alike so that models start equal; left so, every rank would
    then draw the same dropout masks (and other random numbers) for its different samples. The
    stream differs from ``seed_everything(seed)``'s, which built the model's initial weights.
    """
    seed_everything(mix_seed(torch.initial_seed() if seed is None else seed, rank),
                    accelerators=device is None or device.type != "cpu")


def get_rng_state() -> dict[str, Any]:
    """Every global generator's state, in types ``torch.load(weights_only=True)`` accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                  "has_gauss": has_gauss, "gauss": gauss},
        "torch": torch.get_rng_state(),
        # Only once CUDA is in use: reading it initialises CUDA, which a CPU run on a GPU
        # machine must not do (a context on every GPU). Before that, the CUDA generators hold
        # nothing but the seed that torch.manual_seed queued for them, which a resume queues too.
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])


def rng_of_rank(state: Mapping[str, Any], rank: int) -> Any:
    """This rank's RNG state from a checkpoint; rank 0's for a checkpoint of fewer ranks."""
    per_rank = state.get("rng_per_rank") or []
    return per_rank[rank] if rank < len(per_rank) else state["rng"]
