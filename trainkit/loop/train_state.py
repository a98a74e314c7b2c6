"""Where the loop is: the counters every checkpoint carries under ``"trainer"``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class TrainState:
    """Where the loop is; saved in every checkpoint.

    ``epoch`` and ``batch_in_epoch`` are the data position: the loop points the loader there at
    the start of every epoch (and so, after a resume, inside one).
    """

    global_step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of `epoch` already trained on
    samples_seen: int = 0
    skipped_steps: int = 0  # fp16 overflows and non-finite losses
    nonfinite_steps: int = 0
    nonfinite_streak: int = 0
    best_metric: float | None = None  # of checkpoint.monitor
    best_step: int | None = None  # the step best_metric was measured at (best.pt's)
    planned_steps: int = 0  # the run's length when saved; the LR schedule was planned for it
    stop_reason: str | None = None  # request_stop's: the run is over, a re-run trains no more
    micro_batch_size: int = 0  # samples per micro-batch (trainer.micro_batch_size); 0: whole
    # trainer.spike's: the detector's window, the LR-lowered steps, every rollback; None: off
    spike: dict[str, Any] | None = None

    @property
    def epoch_number(self) -> int:
        """The last step's epoch counted from 1, as log lines name it (``epoch`` counts the
        completed ones: right after an epoch's last step both are that epoch's number)."""
        return self.epoch + (self.batch_in_epoch > 0)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; a key an older checkpoint lacks gets its default."""
        for f in fields(self):
            setattr(self, f.name, state.get(f.name, f.default))

    def advance(self, batches: int, samples: int, batches_per_epoch: int) -> None:
        """Count one optimizer step (taken or skipped) over ``batches`` batches."""
        self.global_step += 1
        self.batch_in_epoch += batches
        if self.batch_in_epoch >= batches_per_epoch:  # a checkpoint here resumes at the next epoch
            self.epoch += 1
            self.batch_in_epoch = 0
        self.samples_seen += samples
