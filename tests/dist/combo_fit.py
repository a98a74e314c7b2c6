"""Rows of the combination test (tests/dist/test_combinations.py), several fits per process.

``python tests/dist/combo_fit.py DATA ROWS.json OUT`` (under ``torchrun --nproc-per-node=2``
for the ddp and fsdp rows) trains each row's combination of options three times with the
library API: once uninterrupted, once stopped by a real SIGTERM mid-epoch (rank 0 signals
itself, as a scheduler would), and once resumed from that run's checkpoint. Rank 0 writes
``OUT``: per row and fit, the final weights and buffers (gathered), the EMA's, the summary and
how many graphs torch.compile made. One process launch for all rows saves the ~3 s that each
start of Python and torch costs.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from torchmetrics.classification import MulticlassAccuracy

from trainkit import (
    CheckpointConfig,
    InMemoryLoader,
    Runtime,
    Trainer,
    TrainerConfig,
    load_cifar10,
    load_mnist,
    seed_everything,
)
from trainkit.data.mixing import MixedBatches, batch_mixing
from trainkit.distributed import ddp, group
from trainkit.loop.step import default_forward
from trainkit.models import CifarNet, MnistNet

GLOBAL_BATCH = 16  # 96 training samples: 6 batches an epoch, 2 steps of 3 when accumulating 3
MODELS = {"mnist": (lambda: MnistNet(widths=(4, 8, 16)), load_mnist),
          "cifar": (lambda: CifarNet(widths=(4, 8, 8, 8)), load_cifar10)}
STRATEGIES = {"none": "auto", "ddp": "ddp", "fsdp": "fsdp"}


class SignalAt:
    """``forward`` that sends this process SIGTERM during its ``n``-th training micro-batch, so
    the run stops after that optimizer step (a real signal, at a known step: no race)."""

    def __init__(self, n: int | None) -> None:
        self.left = n

    def __call__(self, model: torch.nn.Module, batch: Any) -> Any:
        if self.left is not None and model.training:
            self.left -= 1
            if self.left == 0:
                os.kill(os.getpid(), signal.SIGTERM)
        return default_forward(model, batch)


def full(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Plain CPU copies; DTensors gathered whole (a collective: every rank calls this)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in tensors.items()}


# trainer.activation_checkpointing's policy when a row has it on, by model: both policies combine
# (under FSDP full only: `features` holds FSDP units, around which selective is refused)
POLICIES = {"mnist": "full", "cifar": "selective"}


def fit(row: dict[str, Any], root: str, run_dir: Path, runtime: Runtime,
        stop_at_step: int | None = None) -> dict[str, Any]:
    import torch._dynamo.utils

    build, load = MODELS[row["model"]]
    policy = "full" if row["strategy"] == "fsdp" else POLICIES[row["model"]]
    seed_everything(0)
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    batch, world = GLOBAL_BATCH // runtime.world_size, runtime.world_size
    loaders = [InMemoryLoader(load(root, train=train, verify=False, download=False), batch,
                              shuffle=train, rank=runtime.rank, world_size=world,
                              channels_last=row["channels_last"]) for train in (True, False)]
    if row["mixup"]:  # data.mixup=0.8 data.cutmix=1.0: soft targets, which cross_entropy takes
        loaders[0] = MixedBatches(loaders[0], batch_mixing(10, mixup=0.8, cutmix=1.0), seed=0,
                                  rank=runtime.rank)
    config = TrainerConfig(
        device="cpu", max_epochs=2, precision=row["precision"],
        strategy=STRATEGIES[row["strategy"]], accumulate_grad_batches=row["accumulate"],
        channels_last=row["channels_last"],
        compile=row["compile"], ema_decay=0.9 if row["ema"] else None,
        activation_checkpointing=[policy, "features"] if row["activation_checkpointing"] else [],
        log_every_n_steps=1, hang_timeout_s=0, freeze=["features.1.*"] if row["freeze"] else [],
        unfreeze_at_epoch=1 if row["freeze"] and row["strategy"] == "none" else None,
        spike={"enabled": row["spike"], "snapshot_every": 1, "warmup": 10**6})
    trainer = Trainer(config, run_dir=run_dir, runtime=runtime,
                      checkpoint=CheckpointConfig(async_save=row["async_save"]))
    signal_at = None
    if stop_at_step is not None and runtime.is_main:
        signal_at = stop_at_step * row["accumulate"]
    torch._dynamo.utils.counters.clear()
    summary = trainer.fit(model, optimizer, loaders[0], val_data=loaders[1],
                          metrics={"acc": MulticlassAccuracy(10, average="micro")},
                          forward=SignalAt(signal_at))
    ema = trainer.checkpointer.parts["ema"]
    return {"summary": summary, "state": full(ddp.unwrap(model).state_dict()),
            "ema": full(ema.state_dict()["weights"]) if ema is not None else None,
            "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
            "buffers_by_rank": group.all_gather(
                {k: v.clone() for k, v in ddp.unwrap(model).named_buffers()})}


def stop_step(row: dict[str, Any], batches_per_epoch: int = 6) -> int:
    """A step in the middle of the second epoch (after an evaluation), not its last."""
    per_epoch = batches_per_epoch // row["accumulate"]
    return per_epoch + max(1, per_epoch // 2)


def main(root: str, rows_file: str, out: str) -> None:
    runtime = Runtime.from_env("cpu")
    group.init_process_group(runtime)
    rows = json.loads(Path(rows_file).read_text())
    results = {}
    for name, row in rows.items():
        base = Path(out).parent / name
        uninterrupted = fit(row, root, base / "whole", runtime)
        preempted = fit(row, root, base / "stopped", runtime, stop_at_step=stop_step(row))
        resumed = fit(row, root, base / "stopped", runtime)
        results[name] = {"whole": uninterrupted, "preempted": preempted, "resumed": resumed,
                         "stop_step": stop_step(row), "dirs": [str(base / "whole"),
                                                               str(base / "stopped")]}
    if runtime.is_main:
        torch.save(results, out)
    group.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("TRAINKIT_DIST_TIMEOUT_S", "60")
    main(*sys.argv[1:4])
