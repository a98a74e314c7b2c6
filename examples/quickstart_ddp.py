"""What each process runs in the quickstart notebook's DDP cell (``trainkit.launch.launch``).

It lives in a module, not in a notebook cell: ``launch`` starts fresh interpreters (``spawn``,
safe with CUDA) that import the function by name, and a cell's functions have no importable name.
"""

from __future__ import annotations

from typing import Any

import torch

from trainkit import InMemoryLoader, Runtime, Trainer, TrainerConfig, load_mnist, seed_everything
from trainkit.models import MnistNet


def train_rank(data_root: str, run_dir: str, max_steps: int, verify: bool = True) -> dict[str, Any]:
    """Train MnistNet with DDP over gloo on the CPU in this process; return its summary.

    ``launch`` has set torchrun's variables (``RANK``, ``WORLD_SIZE``, ...) and joined the
    process group: each rank reads its own shard and the Trainer wraps the model in DDP.
    """
    runtime = Runtime.from_env("cpu")
    # download=False: the notebook fetched the files; two ranks must not both download
    data = load_mnist(data_root, train=True, verify=verify, download=False)
    loader = InMemoryLoader(data, 64, shuffle=True, rank=runtime.rank,
                            world_size=runtime.world_size)
    seed_everything(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = MnistNet()
    trainer = Trainer(TrainerConfig(device="cpu", max_steps=max_steps, log_every_n_steps=10),
                      run_dir=run_dir, runtime=runtime)
    return trainer.fit(model, torch.optim.AdamW(model.parameters(), lr=3e-3), loader)
