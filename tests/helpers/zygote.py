"""Runs of ``python -m trainkit.train`` (or another module) forked from a process that has
imported trainkit already.

A fresh interpreter spends ~4 CPU s importing torch, torchvision, torchmetrics and Hydra before
a test's few-step run trains for ~1 s; the tests start ~100 such runs. ``python -m
tests.helpers.zygote`` imports them once, then, for each request on its stdin (one JSON line:
the module and its arguments, the environment, the folder, where its stdout and stderr go), forks
a child that runs the module as ``python -m`` does (:func:`runpy.run_module` as ``__main__``) and
exits as that interpreter would (atexit handlers, non-daemon threads joined).
Each run is still a process of its own, with its own state; the zygote itself runs no torch op
and starts no thread, so the fork copies an idle, single-threaded process.

What differs from a fresh start: a module reading the environment at import read the zygote's,
so :class:`Zygote` serves only runs whose environment is the one it was started with; a run's
``startup_s`` counts from the fork, not from an interpreter start.
"""

from __future__ import annotations

import gc
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any


def _serve() -> dict[str, Any]:
    """Fork a child for each request; return the request in the child (the zygote loops)."""
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            return request
        replies.write(json.dumps({"pid": pid}).encode() + b"\n")
        replies.flush()
        _, wait_status = os.waitpid(pid, 0)
        status = os.waitstatus_to_exitcode(wait_status)
        replies.write(json.dumps({"pid": pid, "status": status}).encode() + b"\n")
        replies.flush()
    raise SystemExit(0)  # the client closed its end: the session is over


def _become(request: dict[str, Any]) -> None:
    """In the child: the process ``python -m MODULE ARGS`` would be, up to its imports."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    # A fresh interpreter seeds these from the OS; forked children would share the zygote's.
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = [request["module"], *request["argv"]]


def _run_as_main(module: str) -> int:
    """``module`` run as ``__main__``; the status ``python -m module`` exits with, once the
    interpreter's exit has done what a program can see: non-daemon threads joined, atexit
    handlers run, stdout and stderr flushed. Not the teardown of every module after that: in a
    fork it writes to (and so copies) most of the zygote's memory, seconds a run
    (multiprocessing's forked children end the same way)."""
    import atexit
    import runpy
    import traceback

    interrupted = False
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        status = 0
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException as error:  # as the interpreter reports an uncaught exception
        traceback.print_exception(error)
        status, interrupted = 1, isinstance(error, KeyboardInterrupt)
    threading._shutdown()  # the interpreter's own first step: thread pools told, then joined
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if interrupted:  # the interpreter ends itself with SIGINT then: its parent sees the signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return status


def main() -> None:
    import torch.utils.tensorboard  # noqa: F401  (imported by every run's default sink)

    import trainkit.entry.train  # noqa: F401  (torch, torchvision, torchmetrics, Hydra)

    assert threading.active_count() == 1, threading.enumerate()  # a fork copies one thread
    # What the imports made, out of the collector's way: a child's collections then neither
    # walk it nor write to (so copy) its pages.
    gc.freeze()
    request = _serve()
    _become(request)
    os._exit(_run_as_main(request["module"]))


def _steady(env: dict[str, str]) -> dict[str, str]:
    """``env`` less what pytest changes from test to test."""
    return {key: value for key, value in env.items() if key != "PYTEST_CURRENT_TEST"}


class Zygote:
    """The client: one zygote process for this process's runs, started on first use."""

    def __init__(self, env: dict[str, str], cwd: Path, log: Path) -> None:
        """A zygote started in ``env`` and ``cwd``; its own stderr goes to ``log``, in a folder
        of this client's alone (removed by :meth:`close`)."""
        self.env, self.cwd, self.log = dict(env), cwd, log
        self._lock = threading.Lock()
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as stderr:  # the zygote has its own copy
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "tests.helpers.zygote"], cwd=cwd, env=self.env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                bufsize=0)  # unbuffered replies: select() sees every line not yet read

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a run in ``env`` may be forked from this zygote: it imported in that env
        (pytest's name of the current test aside)."""
        return _steady(env) == _steady(self.env) and self._proc.poll() is None

    def run(self, module: str, argv: list[str], env: dict[str, str], folder: Path,
            timeout: float) -> subprocess.CompletedProcess[str]:
        """``python -m module *argv`` in ``env``, as :func:`subprocess.run` with captured text
        output would return it; its outputs pass through files in ``folder``."""
        assert self.serves(env)
        folder.mkdir(parents=True, exist_ok=True)
        out, err = folder / "stdout.txt", folder / "stderr.txt"
        request = {"module": module, "argv": argv, "env": env, "cwd": str(self.cwd),
                   "stdout": str(out), "stderr": str(err)}
        with self._lock:
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
            pid = self._reply(None)["pid"]
            try:
                status = self._reply(timeout)["status"]
            except subprocess.TimeoutExpired:
                os.kill(pid, 9)  # as subprocess.run does on a timeout
                self._reply(None)
                raise subprocess.TimeoutExpired([module, *argv], timeout, out.read_text(),
                                                err.read_text()) from None
        done = subprocess.CompletedProcess([sys.executable, "-m", module, *argv], status,
                                           out.read_text(), err.read_text())
        out.unlink()
        err.unlink()
        return done

    def _reply(self, timeout: float | None) -> dict[str, Any]:
        stream = self._proc.stdout
        if timeout is not None and not select.select([stream], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired("the zygote's child", timeout)
        line = stream.readline()
        if not line:
            raise RuntimeError(f"the zygote ended (status {self._proc.wait()}): "
                               f"{self.log.read_text()[-3000:]}")
        return json.loads(line)

    def close(self) -> None:
        """End the zygote (it exits when its stdin closes) and remove its log's folder."""
        if self._proc.stdin and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        shutil.rmtree(self.log.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
