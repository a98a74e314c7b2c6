"""One rank of the StepVote test: ``torchrun --nproc-per-node 2 vote_worker.py OUT_DIR``.

Rank 1 asks to stop, rank 0's clock says a save is due; each rank writes what the votes gave it
to ``OUT_DIR/rank<N>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from trainkit.core.runtime import Runtime
from trainkit.distributed import group


def main(out: Path) -> None:
    runtime = Runtime.from_env("cpu")
    group.init_process_group(runtime)
    rank = runtime.rank
    wants_stop = [rank == 1]
    vote = group.StepVote(stop=lambda: wants_stop[0], save_due=lambda: rank == 0)
    seen: dict[str, object] = {"active": vote.active}
    seen["plain"] = vote.stop_and_save()
    seen["nonfinite"] = vote.nonfinite(rank == 1)  # rank 1's loss was NaN: both skip
    seen["carried"] = vote.stop_and_save()  # agreed with the NaN check: no second collective
    seen["nonfinite_tensor"] = bool(vote.nonfinite(torch.tensor(rank == 0)))
    wants_stop[0] = False  # the stop is withdrawn before a vote anew
    seen["again"] = vote.stop_and_save(again=True)
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    group.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
