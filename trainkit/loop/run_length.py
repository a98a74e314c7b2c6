"""A run's length said where a limit or the schedule changes it: one line each, at the start
(:class:`StartLines`, after the run's first line).

``trainer.max_steps`` alone is a run's length (``max_epochs`` null: no epoch limit; see
:attr:`trainkit.config.TrainerConfig.epoch_limit`). Where both limits are set, the one that ends
the run first wins, and the line says so when it takes whole epochs or steps the other asked for:
``trainer.max_steps=30`` with an experiment's ``max_epochs: 1`` once ran 6 steps and said nothing.
A schedule's warm-up longer than the run leaves the learning rate still rising at the end.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from trainkit.config import TrainerConfig
from trainkit.loop.step import steps_per_epoch


def length_notes(trainer: TrainerConfig, batches_per_epoch: int,
                 sched: Mapping[str, Any] | None) -> list[str]:
    """The lines to say about this run's length: a limit that cuts the other short, and a
    schedule (``sched.warmup_steps``) that does not fit the run's steps."""
    per_epoch = steps_per_epoch(batches_per_epoch, trainer.accumulate_grad_batches)
    epochs, steps = trainer.max_epochs, trainer.max_steps
    notes = []
    if epochs is not None and steps > 0:
        if per_epoch * epochs < steps:
            notes.append(f"trainer.max_epochs={epochs} ends the run after {per_epoch * epochs} "
                         f"steps ({per_epoch} an epoch), before trainer.max_steps={steps}: set "
                         "trainer.max_epochs=null to let max_steps alone decide")
        elif steps <= per_epoch * (epochs - 1):
            notes.append(f"trainer.max_steps={steps} ends the run in epoch "
                         f"{-(-steps // per_epoch)} of trainer.max_epochs={epochs} ({per_epoch} "
                         "steps an epoch): set trainer.max_steps=-1 to let max_epochs decide")
    total = min(per_epoch * trainer.epoch_limit, steps if steps > 0 else sys.maxsize)
    warmup = (sched or {}).get("warmup_steps")
    if isinstance(warmup, int) and warmup >= total:
        notes.append(f"sched.warmup_steps={warmup} does not fit the run's {total} steps: the "
                     "learning rate is still warming up when the run ends; lower "
                     "sched.warmup_steps")
    return notes


class StartLines:
    """A callback that says ``info`` and ``warnings`` lines as training starts, after the run's
    first line (what trains where, for how long)."""

    def __init__(self, info: Sequence[str], warnings: Sequence[str]) -> None:
        self.info, self.warnings = list(info), list(warnings)

    def on_fit_start(self, trainer: Any) -> None:
        log = logging.getLogger("trainkit")
        for line in self.info:
            log.info(line)
        for line in self.warnings:
            log.warning(line)
