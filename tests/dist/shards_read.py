"""Run under torchrun: each rank reads data=webdataset shards for 2 epochs with 2 workers and
writes the sample keys of every batch to ``<out>/keys<rank>.jsonl``.

``--pause-at E B``: after batch B of epoch E, write ``<out>/paused<rank>`` (this process's id)
and wait for SIGTERM; on it, the ranks agree to stop after that batch, save the loader's
position to ``<out>/state<rank>.json`` and exit 75. ``--resume`` starts from that position.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from trainkit.config import DataConfig
from trainkit.data.pipeline import shard_loaders
from trainkit.core.runtime import Runtime

stop = threading.Event()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("out", type=Path)
    p.add_argument("--pause-at", type=int, nargs=2, default=None)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    dist.init_process_group("gloo")
    runtime = Runtime.from_env("cpu")
    cfg = DataConfig(name="webdataset", root=args.root, batch_size=3, num_workers=2,
                     image_size=8, shuffle_buffer=4)
    train, _, _ = shard_loaders(cfg, runtime, seed=5)
    loader = train.loader  # the ShardLoader: batches with their sample keys
    rank = runtime.rank
    state = args.out / f"state{rank}.json"
    epoch, start = json.loads(state.read_text()).values() if args.resume else (0, 0)
    counts = []
    with open(args.out / f"keys{rank}.jsonl", "a") as keys:
        for e in range(epoch, 2):
            first = start if e == epoch else 0  # this script holds the position, as fit does
            n = 0
            for batch in loader.batches(e, first):
                keys.write(json.dumps({"epoch": e, "keys": batch.keys}) + "\n")
                keys.flush()
                n += 1
                if args.pause_at == [e, first + n - 1]:
                    (args.out / f"paused{rank}").write_text(str(os.getpid()))
                    stop.wait(60)
                asked = torch.tensor(float(stop.is_set()))
                dist.all_reduce(asked, op=dist.ReduceOp.MAX)  # DDP's step: equal counts or hang
                if asked.item():
                    state.write_text(json.dumps({"epoch": e, "batch": first + n}))
                    dist.destroy_process_group()
                    return 75
            counts.append(n)
    every = [None] * runtime.world_size
    dist.all_gather_object(every, counts)
    print(f"rank {rank} batches per epoch {every}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
