"""A script of two phases under ``trainkit.preemptible()`` for the signal tests: phase ``a``
trains a small net, phase ``b`` fine-tunes a copy of it, each ``fit`` in its own run dir.

``--signal-at`` makes the script send itself a real signal at one point: ``setup`` (SIGTERM
inside phase a's ``fit``, before its first step: the loader's ``len``), ``between`` (SIGINT
after phase a), ``step`` (SIGTERM at the end of phase b's step 3, a callback's).
``--unseeded`` draws phase a's initial weights from an unseeded generator: runs differ.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn

import trainkit
from tests.helpers.spikes import ListLoader, batches
from trainkit import CheckpointConfig, Trainer, TrainerConfig


class SignalInLen(ListLoader):
    """A loader that sends ``signum`` to its process when ``fit`` first asks its length."""

    def __init__(self, data: list, signum: int) -> None:
        super().__init__(data)
        self.signum: int | None = signum

    def __len__(self) -> int:
        if self.signum is not None:
            signum, self.signum = self.signum, None
            os.kill(os.getpid(), signum)
        return super().__len__()


class SignalAtStep:
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer: Any, step: int) -> None:
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def phase(run_dir: Path, model: nn.Module, data: Any, callbacks: tuple = ()) -> dict[str, Any]:
    config = TrainerConfig(device="cpu", max_steps=8, log_every_n_steps=4, advice=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return Trainer(config, run_dir=run_dir, checkpoint=CheckpointConfig(every_n_steps=4),
                   callbacks=callbacks).fit(model, optimizer, data)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--signal-at", choices=["setup", "between", "step"], default=None)
    parser.add_argument("--unseeded", action="store_true")
    args = parser.parse_args()
    at = args.signal_at
    with trainkit.preemptible():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))
        if args.unseeded:
            unseeded = torch.Generator()
            unseeded.seed()  # from the OS's entropy: another start each run
            with torch.no_grad():
                model[0].weight.normal_(0.0, 0.2, generator=unseeded)
        data = batches(8)
        phase(args.run_dir / "a", model,
              SignalInLen(data, signal.SIGTERM) if at == "setup" else ListLoader(data))
        print("phase a done", flush=True)
        if at == "between":
            os.kill(os.getpid(), signal.SIGINT)
        summary = phase(args.run_dir / "b", model, ListLoader(batches(8, split=1)),
                        (SignalAtStep(3),) if at == "step" else ())
        print(f"phase b {summary['status']}", flush=True)


if __name__ == "__main__":
    main()
