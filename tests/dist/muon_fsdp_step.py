"""One ``torch.optim.Muon`` step on a matrix sharded by FSDP2 and on the same matrix unsharded.

``python -m tests.dist.muon_fsdp_step OUT`` under ``torchrun --nproc-per-node=2``: rank 0
writes ``OUT`` (a ``torch.save`` of the largest difference between the two updated matrices
and the largest update): why ``optim=muon`` is refused under ``trainer.strategy=fsdp``.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    sharded = nn.Sequential(nn.Linear(64, 48, bias=False), nn.Linear(48, 4, bias=False))
    plain = nn.Sequential(nn.Linear(64, 48, bias=False), nn.Linear(48, 4, bias=False))
    plain.load_state_dict(sharded.state_dict())
    before = plain[0].weight.detach().clone()
    fully_shard(sharded)
    x = torch.randn(4, 64)
    for model in (sharded, plain):
        optimizer = torch.optim.Muon(model.parameters(), lr=0.1)
        model(x).square().sum().backward()
        optimizer.step()
    gathered = sharded[0].weight.full_tensor()
    if dist.get_rank() == 0:
        torch.save({"apart": (gathered - plain[0].weight).abs().max().item(),
                    "update": (plain[0].weight - before).abs().max().item()}, out)
    dist.barrier()  # both ranks done with gloo before either tears it down
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
