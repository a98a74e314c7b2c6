"""The LM example under torchrun, with rank 1 alone asking to stop at step 5 (see
test_char_lm_torchrun.py): ``python -m torch.distributed.run ... -m tests.dist.char_lm_stop``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tests.helpers.callbacks import StopOnRank


class SayLastStep:
    """Prints the step this rank ended at."""

    def on_fit_end(self, trainer: Any, summary: dict[str, Any]) -> None:
        print(f"rank {trainer.runtime.rank} ended at step {trainer.state.global_step}",
              flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import char_lm

    char_lm.main(sys.argv[1:], callbacks=[StopOnRank(5, rank=1), SayLastStep()])
