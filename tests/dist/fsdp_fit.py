"""A few library-API fits of FlatNet, one per precision, for the FSDP tests.

``python tests/dist/fsdp_fit.py OUT`` trains in one process without sharding (the reference);
under ``torchrun --nproc-per-node=2`` the same with ``trainer.strategy=fsdp`` and half the
per-rank batch, so both see the same global batches. Rank 0 writes ``OUT``: per case the full
(gathered) weights and EMA weights, the logged metrics, the summary, and how many elements of
the weights, EMA and optimizer state this rank holds (its shard) against the full model's.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn

from tests.dist.nets import FlatNet
from trainkit import InMemoryLoader, Runtime, Trainer, TrainerConfig, load_mnist, seed_everything
from trainkit.distributed import fsdp, group

# fp32 keeps gathered weights after forward: the path where an evaluation (with the EMA's weights
# swapped in) would leave stale gathered copies behind for the next training step.
CASES: dict[str, dict[str, Any]] = {"32": {"fsdp_reshard_after_forward": False},
                                    "bf16-mixed": {}, "16-mixed": {}}
GLOBAL_BATCH = 32


class Recorder:
    def __init__(self) -> None:
        self.logged: list[dict[str, float]] = []

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append({"step": step, **metrics})


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach().clone()


def held(tensors: Any) -> int:
    """Elements this rank stores for ``tensors`` (its local shards)."""
    return sum(fsdp.local(t).numel() for t in tensors if isinstance(t, torch.Tensor))


def fit(root: str, precision: str, runtime: Runtime, **settings: Any) -> dict[str, Any]:
    sharded = runtime.world_size > 1
    seed_everything(0)
    model = FlatNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = GLOBAL_BATCH // runtime.world_size
    train = InMemoryLoader(load_mnist(root, train=True, verify=False, download=False), batch,
                           shuffle=True, rank=runtime.rank, world_size=runtime.world_size)
    # 255 samples: 128 and 127 per rank, in batches of 127: 2 batches on rank 0, 1 on rank 1
    val = InMemoryLoader(load_mnist(root, train=False, verify=False, download=False), 127,
                         shuffle=False, rank=runtime.rank, world_size=runtime.world_size)
    config = TrainerConfig(  # 2 epochs of 3 steps: an evaluation between them
        device="cpu", max_epochs=2, precision=precision, accumulate_grad_batches=2,
        gradient_clip_val=0.5, ema_decay=0.9, activation_checkpointing=["net.1"],
        log_every_n_steps=1, strategy="fsdp" if sharded else "auto", **settings)
    recorder = Recorder()
    trainer = Trainer(config, runtime=runtime, sinks=[recorder])
    summary = trainer.fit(model, optimizer, train, val_data=val)
    ema = trainer.checkpointer.parts["ema"]
    state = [v for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {
        "weights": {k: full(v) for k, v in model.state_dict().items()},
        "ema": {k: full(v) for k, v in ema.state_dict()["weights"].items()},
        "logged": recorder.logged, "summary": summary,
        "held": {"params": held(model.parameters()), "ema": held(ema.shadow),
                 "optimizer": held(state),
                 "full": sum(p.numel() for p in FlatNet().parameters())},
        "types": {"param": type(next(model.parameters())).__name__,
                  "optimizer_param": type(optimizer.param_groups[0]["params"][0]).__name__,
                  "module": type(model).__name__},
        "sharded": fsdp.is_sharded(model) and isinstance(model, nn.Module),
        "val_batches": len(val),
    }


def main(root: str, out: str) -> None:
    runtime = Runtime.from_env("cpu")
    group.init_process_group(runtime)
    results = {precision: fit(root, precision, runtime, **settings)
               for precision, settings in CASES.items()}
    if runtime.is_main:
        torch.save(results, out)
    group.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("TRAINKIT_DIST_TIMEOUT_S", "60")
    main(sys.argv[1], sys.argv[2])
