"""``trainkit.preemptible()`` in this process: a real signal in the block is one line and exit
75; a fit stopped inside it exits 75 after its checkpoint; the handlers come back after it."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

import trainkit
from tests.conftest import last_checkpoint, preemption_signals_heard
from tests.helpers.spikes import ListLoader, batches, net
from trainkit import CheckpointConfig, Trainer, TrainerConfig


def test_a_signal_while_loading_is_one_line_and_exit_75(
        capsys: pytest.CaptureFixture[str]) -> None:
    with preemption_signals_heard():
        with pytest.raises(SystemExit) as stop, trainkit.preemptible():
            signal.raise_signal(signal.SIGUSR1)  # SLURM's warning, while "loading"
        assert stop.value.code == trainkit.EXIT_PREEMPTED == 75
        assert capsys.readouterr().err.strip() == (
            "trainkit: stopped by SIGUSR1 outside the training steps (before the first or after "
            "the last); re-run the same command to start or resume the run")


def test_the_handlers_come_back_after_the_block_and_ignored_signals_stay_ignored() -> None:
    with preemption_signals_heard():
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup
        before = signal.getsignal(signal.SIGTERM)
        with trainkit.preemptible():
            assert signal.getsignal(signal.SIGTERM) is not before
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is before
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN


def test_a_fit_stopped_inside_the_block_exits_75_after_its_checkpoint(tmp_path: Path) -> None:
    def fit(run_dir: Path) -> dict:
        model = net()
        return Trainer(TrainerConfig(device="cpu", advice=False), run_dir=run_dir,
                       checkpoint=CheckpointConfig()).fit(
            model, torch.optim.SGD(model.parameters(), lr=0.1), ListLoader(batches(6)),
            stop_at_step=2)  # stops as a signal would

    assert fit(tmp_path / "outside")["status"] == "preempted"  # outside: fit returns
    with preemption_signals_heard(), pytest.raises(SystemExit) as stop, trainkit.preemptible():
        fit(tmp_path / "inside")
        raise AssertionError("the script went on after a preempted fit")
    assert stop.value.code == 75
    assert last_checkpoint(tmp_path / "inside")["global_step"] == 2
