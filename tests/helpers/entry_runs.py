"""``python -m tests.helpers.entry_runs RUNS.json``: several runs of the real entry point, one after
the other in one process, for tests of bad input that ends a run before it trains.

Each run is what ``python -m trainkit.train ARGS`` does (``trainkit.train.main`` with that
``sys.argv``): its status, and its stdout and stderr at the file-descriptor level, go to
``<prefix>.status``, ``<prefix>.out`` and ``<prefix>.err``. The interpreter, torch and Hydra
start once for all of them (a start is most of such a run's cost); between runs the process's
environment, working folder, signal handlers, logging handlers and Hydra's global state are put
back as they were.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def _outputs_to(prefix: str) -> Iterator[None]:
    """fds 1 and 2 (and sys.stdout/stderr on them) into ``prefix``.out / .err."""
    saved = [os.dup(1), os.dup(2)]
    try:
        for fd, suffix in ((1, ".out"), (2, ".err")):
            target = os.open(prefix + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)


@contextlib.contextmanager
def _put_back() -> Iterator[None]:
    """The process state a run may change, restored afterwards."""
    from hydra.core.global_hydra import GlobalHydra

    env, cwd, argv = dict(os.environ), os.getcwd(), list(sys.argv)
    handlers = {s: signal.getsignal(s) for s in signal.valid_signals()
                if signal.getsignal(s) is not None}
    loggers = {name: list(logging.getLogger(name).handlers) for name in ("", "trainkit")}
    try:
        yield
    finally:
        GlobalHydra.instance().clear()
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv = argv
        for signum, handler in handlers.items():
            with contextlib.suppress(OSError, ValueError):
                signal.signal(signum, handler)
        for name, kept in loggers.items():
            logger = logging.getLogger(name)
            for handler in [h for h in logger.handlers if h not in kept]:
                logger.removeHandler(handler)
                handler.close()


def run(argv: list[str], prefix: str) -> int:
    """One run of the entry point with ``argv``; its exit status."""
    from trainkit.train import main

    status = 0
    with _put_back(), _outputs_to(prefix):
        sys.argv = [sys.argv[0], *argv]
        try:
            main()
        except SystemExit as stop:
            code = stop.code
            status = code if isinstance(code, int) else (0 if code is None else 1)
        except BaseException:  # a bug: its traceback, as the interpreter would print it
            import traceback

            traceback.print_exc()
            status = 1
    Path(prefix + ".status").write_text(str(status))
    return status


def main(spec: str) -> None:
    for item in json.loads(Path(spec).read_text()):
        run(item["argv"], item["prefix"])


if __name__ == "__main__":
    main(sys.argv[1])
