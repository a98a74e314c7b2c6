"""One rank of the micro-batch vote test (tests/dist/test_micro_batch.py), started by torchrun.

Rank 1's model runs out of memory above 4 samples, rank 0's never: both must move to 4. Writes
``<out>/rank<R>.pt`` with the final weights, the micro-batch size and the sizes its forward saw.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from tests.unit.loop.test_micro_batch import Fits
from trainkit import CheckpointConfig, Trainer, TrainerConfig
from trainkit.distributed import group


def batches(rank: int, n: int = 2, size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(size, 6, generator=g), torch.randint(0, 3, (size,), generator=g))
            for _ in range(n)]


def main(out: Path) -> None:
    rank = int(os.environ["RANK"])
    model = Fits(limit=16 if rank == 0 else 4)
    trainer = Trainer(TrainerConfig(device="cpu", max_steps=2, micro_batch_size="auto",
                                    log_every_n_steps=1),
                      run_dir=out / "run", checkpoint=CheckpointConfig(every_n_steps=1))
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.5), batches(rank))
    torch.save({"weights": model.net.state_dict(), "sizes": model.sizes,
                "micro_batch_size": trainer.state.micro_batch_size}, out / f"rank{rank}.pt")
    # The group fit joined is left before the interpreter exits, as docs/distributed.md's
    # script does: otherwise gloo's worker thread may free the last collective's tensors during
    # the interpreter's finalization, and the rank aborts ("terminate called", exit -6) after
    # a finished run (group.shutdown's store barrier explains it).
    group.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
