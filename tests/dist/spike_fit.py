"""One rank of the 2-rank loss-spike test (tests/dist/test_spike.py), started by torchrun.

Each rank trains on its own share of the stream of tests/helpers/spikes.py; only rank 1's
batch 35 is poisoned. Fits under DDP (poisoned, and clean) and FSDP (poisoned), each into
``<out>/<name>``; writes ``<out>/rank<R>.pt``: per fit the summary, the whole weights and the
rollback records.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from tests.helpers.spikes import ListLoader, batches, net
from trainkit import Trainer, TrainerConfig
from trainkit.distributed import ddp, group

SPIKE = {"enabled": True, "warmup": 10, "window": 20, "snapshot_every": 10}


def fit(out: Path, rank: int, strategy: str, poison: tuple[int, ...]) -> dict[str, Any]:
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    config = TrainerConfig(device="cpu", strategy=strategy, log_every_n_steps=10,
                           log_every_n_seconds=0, hang_timeout_s=0, spike=SPIKE)
    trainer = Trainer(config, run_dir=out)
    summary = trainer.fit(model, optimizer, ListLoader(batches(60, poison, rank=rank)),
                          val_data=batches(4, split=1, rank=rank))
    weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
               for k, v in ddp.unwrap(model).state_dict().items()}
    return {"summary": summary, "weights": weights,
            "rollbacks": trainer.state.spike["rollbacks"]}


def main(out: Path) -> None:
    rank = int(os.environ["RANK"])
    poison = (35,) if rank == 1 else ()
    results = {name: fit(out / name, rank, strategy, poison if name != "clean" else ())
               for name, strategy in (("ddp", "ddp"), ("clean", "ddp"), ("fsdp", "fsdp"))}
    torch.save(results, out / f"rank{rank}.pt")
    group.shutdown()  # before the interpreter exits (see tests/dist/micro_batch_fit.py)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
