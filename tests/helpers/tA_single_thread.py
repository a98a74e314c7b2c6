"""The real entry point and real processes, each with one intra-op thread (``OMP_NUM_THREADS=1``).

On the 2-core CI machine two pytest workers each run a training process; with torch's default of
two threads per process the threads spin-wait on each other and a small model's step costs
several times its CPU (a 188-step MNIST run: ~60 CPU s with two threads, ~3 s with one, on a
loaded machine). tests/integration/test_probe.py and the torchrun tests do the same. What the
tests check (signals, exit codes, checkpoints, bitwise resumes) does not depend on the thread
count, and every run a test compares with another gets the same environment, so bitwise equality
means what it did.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import REPO, hear_preemption_signals, offline_env
from tests.conftest import run_train as _run_train


def env(**extra: str) -> dict[str, str]:
    """:func:`tests.conftest.offline_env` with one intra-op thread (and ``extra``)."""
    return offline_env(OMP_NUM_THREADS="1", **extra)


def run_train(*overrides: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """:func:`tests.conftest.run_train` in :func:`env`."""
    return _run_train(*overrides, env=env(), timeout=timeout)


def start_in_own_group(command: list[str], out: Path) -> subprocess.Popen:
    """:func:`tests.conftest.start_in_own_group` in :func:`env`: the leader of a new session and
    process group (``setsid``), hearing the preemption signals as when started from a terminal;
    its output goes to ``out``."""
    with open(out, "ab") as stream:  # the child has its own copy
        return subprocess.Popen(command, cwd=REPO, env=env(TRAINKIT_DIST_TIMEOUT_S="60"),
                                stdout=stream, stderr=subprocess.STDOUT,
                                preexec_fn=hear_preemption_signals, start_new_session=True)
