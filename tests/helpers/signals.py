"""The preemption signals heard again in a process whose parent ignored them."""

from __future__ import annotations

import signal

from trainkit.core.signals import PREEMPTION_SIGNALS


def hear_preemption_signals() -> None:
    """Undo inherited SIG_IGNs: ``nohup`` ignores SIGHUP and a shell's background job SIGINT, and
    trainkit rightly leaves an ignored signal ignored. For a child the signal tests start (its
    ``preexec_fn``, or a forked run's first step), so that it hears them as when started from a
    terminal."""
    for signum in PREEMPTION_SIGNALS:
        if signal.getsignal(signum) is signal.SIG_IGN:
            default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
            signal.signal(signum, default)
