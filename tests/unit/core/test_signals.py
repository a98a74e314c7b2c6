"""The entry point's handlers outside the training steps (real signals, in this process)."""

from __future__ import annotations

import signal

import pytest

from tests.conftest import preemption_signals_heard
from trainkit.core.signals import StoppedOutsideTraining, stop_outside_training


def test_a_signal_outside_training_raises_once_then_the_same_one_is_ignored() -> None:
    with preemption_signals_heard():
        stop_outside_training()
        with pytest.raises(StoppedOutsideTraining) as info:
            signal.raise_signal(signal.SIGHUP)
        assert info.value.signum == signal.SIGHUP and "\n" not in info.value.message
        signal.raise_signal(signal.SIGHUP)  # torchrun's forwarded copy: ignored, no death
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # a second signal acts at once


def test_an_ignored_signal_stays_ignored_outside_training() -> None:
    with preemption_signals_heard():
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup
        stop_outside_training()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
