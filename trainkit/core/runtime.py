"""Where this process runs: one frozen object instead of loose rank/device variables."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from trainkit.core.device import resolve_device


@dataclass(frozen=True)
class Runtime:
    """Facts about this process that the rest of trainkit reads and never changes.

    Example:
        >>> rt = Runtime.from_env("cpu")
        >>> rt.is_main, rt.world_size
        (True, 1)
    """

    device: torch.device
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        """True on the one process that writes logs, checkpoints and summaries."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, device: str | torch.device = "auto") -> Runtime:
        """Read rank and world size from torchrun's environment variables and pick the device.

        Raises:
            TrainkitError: ``device`` does not exist here, or, on CUDA, this rank has no GPU of
                its own (more processes on the node than visible GPUs).
        """
        rank = int(os.environ.get("RANK", 0))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        return cls(resolve_device(device, local_rank, local_world_size), rank, local_rank,
                   world_size)
