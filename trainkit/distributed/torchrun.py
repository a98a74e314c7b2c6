"""Local processes through torchrun's own machinery (torch.distributed.elastic).

:func:`torchrun_command` and :func:`run_torchrun` are what ``python -m trainkit.launch`` runs
(its command line: :mod:`trainkit.entry.launch`); :func:`launch` runs a Python function in N
processes, from a script or a notebook. Nothing here replaces torchrun, and multi-node jobs use
torchrun directly (see docs/distributed.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from trainkit.core.errors import TrainkitError
from trainkit.core.runtime import Runtime
from trainkit.core.signals import EXIT_PREEMPTED
from trainkit.distributed import group


def default_nproc() -> int:
    """One process per visible GPU (``CUDA_VISIBLE_DEVICES`` applies); one without CUDA."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def torchrun_command(overrides: Sequence[str], *, nproc: int | None = None,
                     max_restarts: int = 0, module: str = "trainkit.train") -> list[str]:
    """The torchrun command line that runs ``python -m <module> <overrides>`` on this machine.

    ``--standalone`` makes torchrun pick a free port and a fresh run id, so two jobs on one
    machine do not collide.

    Example:
        >>> torchrun_command(["+exp=cifar"], nproc=2)[3:6]
        ['--standalone', '--nproc-per-node=2', '--max-restarts=0']
    """
    nproc = default_nproc() if nproc is None else nproc
    if nproc < 1:
        raise TrainkitError(f"the number of processes must be >= 1, got {nproc}")
    if max_restarts < 0:
        raise TrainkitError(f"--max-restarts must be >= 0, got {max_restarts}")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", "-m", module,
            *overrides]


def launch(fn: Callable[..., Any], *args: Any, nprocs: int | None = None,
           max_restarts: int = 0, start_method: str = "spawn") -> list[Any]:
    """Run ``fn(*args)`` in ``nprocs`` local processes joined in a process group; return the
    results by rank.

    Each process gets torchrun's environment and a process group up around ``fn``, so
    :meth:`Runtime.from_env` and the Trainer work in it unchanged. ``fn`` and ``args`` are
    pickled: under ``start_method="spawn"`` (the default, safe with CUDA) ``fn`` must be
    importable; ``"fork"`` (Linux) also runs a notebook's functions.

    Raises:
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a process failed
            (after ``max_restarts`` restarts of the whole group).

    Example:
        >>> def work(scale):  # doctest: +SKIP
        ...     return Runtime.from_env().rank * scale
        >>> launch(work, 10, nprocs=2)  # doctest: +SKIP
        [0, 10]
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    nprocs = default_nproc() if nprocs is None else nprocs
    if nprocs < 1:
        raise TrainkitError(f"nprocs must be >= 1, got {nprocs}")
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=uuid.uuid4().hex,
        rdzv_backend="c10d", rdzv_endpoint="localhost:0",  # port 0: any free port
        max_restarts=max_restarts, start_method=start_method, monitor_interval=0.1,
    )
    with _caller_state_restored():
        results = elastic_launch(config, _in_process_group)(fn, *args)
    return [results[rank] for rank in sorted(results)]


# torch's launcher sets this in the caller's environment (the signals its agent forwards)
SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"


@contextlib.contextmanager
def _caller_state_restored() -> Iterator[None]:
    """Put back what torch's agent changes for the launch and never restores: the handlers of
    SIGTERM, SIGINT, SIGHUP and SIGQUIT, and :data:`SIGNALS_ENV`. In a notebook kernel or a
    sweep they would outlive it, the variable passed on to every process it starts later."""
    before: dict[int, Any] = {}  # the agent installs handlers only from the main thread
    if threading.current_thread() is threading.main_thread():
        before = {signum: signal.getsignal(signum) for signum in signal.valid_signals()}
    variable = os.environ.get(SIGNALS_ENV)
    try:
        yield
    finally:
        for signum, handler in before.items():
            # None: a handler not set from Python, which Python cannot set back
            if handler is not None and signal.getsignal(signum) is not handler:
                signal.signal(signum, handler)
        if variable is None:
            os.environ.pop(SIGNALS_ENV, None)
        else:
            os.environ[SIGNALS_ENV] = variable


def _in_process_group(fn: Callable[..., Any], *args: Any) -> Any:
    """Run in each launched process: join the group, call ``fn``, leave the group."""
    created = group.init_process_group(Runtime.from_env())
    # On an exception, no shutdown: its barrier would wait for ranks that may have failed too.
    result = fn(*args)
    if created:
        group.shutdown()
    return result


def run_torchrun(args: Sequence[str]) -> int:
    """Run torchrun with ``args`` (its command line) in this process; return an exit status.

    0 when every worker succeeded; 75 (:data:`~trainkit.core.signals.EXIT_PREEMPTED`) when the
    workers stopped on a signal after saving, or this process was signalled and forwarded it
    (either way re-running resumes); else the status of the worker that failed first (2 for bad
    input), whose own last line said why; 1, with torchrun's report, when a worker died of a
    signal.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        with _quiet_failure_log():
            run(parse_args(list(args)))
    except ChildFailedError as err:
        # A rank exits 75 only after every rank passed the stop checkpoint's barrier: the save is
        # complete. torchrun then sends SIGTERM to the ranks still exiting, which at interpreter
        # shutdown (Python handlers gone) die of it: -15 beside a 75 is the same clean stop.
        codes = {failure.exitcode for failure in err.failures.values()}
        if EXIT_PREEMPTED in codes and codes <= {EXIT_PREEMPTED, -signal.SIGTERM}:
            return EXIT_PREEMPTED  # rank 0 said so: "stopped at step N; re-run ... to resume"
        _, first = err.get_first_failure()
        if first.exitcode > 0:  # the worker printed its own error last; its status says what
            return first.exitcode
        print(err, file=sys.stderr)  # killed by a signal: which rank, and how
        return 1
    except SignalException:
        # torchrun forwarded the signal: the workers saved and stopped, or, slower than its grace
        # period, were killed; the newest complete checkpoint is there to resume from.
        return EXIT_PREEMPTED
    return 0


@contextlib.contextmanager
def _quiet_failure_log() -> Iterator[None]:
    """Without torchrun's own "failed (exitcode: N) local_rank: ..." line, which would follow the
    worker's one-line error; where a worker died without one, the report printed instead names
    the rank, its exit code and its pid too."""
    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
