"""Runs of ``python -m trainkit.train`` (or another module) forked from a process that has
imported trainkit already.

A fresh interpreter spends ~4 CPU s importing torch, torchvision, torchmetrics and Hydra before
a test's few-step run trains for ~1 s; the tests start ~100 such runs. ``python -m
tests.helpers.zygote`` imports them once, then, for each request on its stdin (one JSON line:
its id, the module and its arguments, the environment, the folder, where its stdout and stderr
go, whether it leads a session of its own and hears the preemption signals again), forks
a child that runs the module as ``python -m`` does (:func:`runpy.run_module` as ``__main__``) and
exits as that interpreter would (atexit handlers, non-daemon threads joined).
Each run is still a process of its own, with its own state; the zygote itself runs no torch op
and starts no thread, so the fork copies an idle, single-threaded process.

What differs from a fresh start: a module reading the environment at import read the zygote's,
so :class:`Zygote` serves only runs whose environment is the one it was started with; a run's
``startup_s`` counts from the fork, not from an interpreter start.

Runs may overlap (:meth:`Zygote.start` returns at once with a :class:`Forked`, which stands for
:class:`subprocess.Popen`): the tests that signal or kill a run, or train two side by side, fork
them too. Each reply names its request, so the zygote reports each child's end when it comes.
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

from tests.helpers.signals import hear_preemption_signals


def _serve() -> dict[str, Any]:
    """Fork a child for each request; return the request in the child (the zygote loops,
    reporting each child's pid at its start and its status at its end)."""
    children: dict[int, int] = {}  # pid: request id
    pending = b""

    def reply(message: dict[str, Any]) -> None:
        sys.stdout.buffer.write(json.dumps(message).encode() + b"\n")
        sys.stdout.buffer.flush()

    while True:
        # with children running, a look every 20 ms for their ends (no SIGCHLD handler: each
        # fork would inherit it)
        readable = select.select([0], [], [], 0.02 if children else None)[0]
        while children:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            reply({"id": children.pop(pid), "status": os.waitstatus_to_exitcode(wait_status)})
        if not readable:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:  # the client closed its end: the session is over
            raise SystemExit(0)
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                return request
            children[pid] = request["id"]
            reply({"id": request["id"], "pid": pid})


def _become(request: dict[str, Any]) -> None:
    """In the child: the process ``python -m MODULE ARGS`` would be, up to its imports."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    mode = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request["append"] else os.O_TRUNC)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        if fd == 2 and path == request["stdout"]:  # stderr=subprocess.STDOUT
            os.dup2(1, 2)
            continue
        target = os.open(path, mode, 0o644)
        os.dup2(target, fd)
        os.close(target)
    if request["new_session"]:
        os.setsid()
    if request["hear_signals"]:  # as the preexec_fn of a Popen
        hear_preemption_signals()
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


class Forked:
    """A run forked by a :class:`Zygote`, as much of :class:`subprocess.Popen` as the tests use:
    ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill`` and
    ``communicate`` (the text of its output files, when it was asked to capture them)."""

    def __init__(self, args: list[str], captured: tuple[Path, Path] | None) -> None:
        self.args, self.pid, self.returncode = args, 0, None
        self._captured = captured
        self._started, self._ended = threading.Event(), threading.Event()
        self._error: str | None = None  # the zygote's own end, when it came first

    def _end(self, status: int | None, error: str | None = None) -> None:
        self.returncode, self._error = status, error
        self._started.set()
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        if self._error is not None:
            raise RuntimeError(self._error)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:  # as Popen: no signal to a process known to have ended
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """Wait for the end; the captured stdout and stderr, as text (the files then removed)."""
        self.wait(timeout)
        if self._captured is None:
            return None, None
        texts = tuple(path.read_text() for path in self._captured)
        for path in self._captured:
            path.unlink()
        self._captured = None
        return texts


class Zygote:
    """The client: one zygote process for this process's runs, started on first use."""

    def __init__(self, env: dict[str, str], cwd: Path, log: Path) -> None:
        """A zygote started in ``env`` and ``cwd``; its own stderr goes to ``log``, in a folder
        of this client's alone (removed by :meth:`close`)."""
        self.env, self.cwd, self.log = dict(env), cwd, log
        self._lock = threading.Lock()
        self._runs: dict[int, Forked] = {}  # by request id, until each ends
        self._next_id = 0
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as stderr:  # the zygote has its own copy
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "tests.helpers.zygote"], cwd=cwd, env=self.env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
        threading.Thread(target=self._read_replies, daemon=True).start()

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a run in ``env`` may be forked from this zygote: it imported in that env
        (pytest's name of the current test aside)."""
        return _steady(env) == _steady(self.env) and self._proc.poll() is None

    def start(self, module: str, argv: list[str], env: dict[str, str], *,
              stdout: Path, stderr: Path, append: bool = False, new_session: bool = False,
              hear_signals: bool = False, captured: bool = False) -> Forked:
        """``python -m module *argv`` in ``env``, started as :class:`subprocess.Popen` would,
        its output written to ``stdout`` and ``stderr`` (the same path: merged; ``append``: at
        their ends), as leader of a new session with ``new_session``, with the preemption
        signals an ignoring parent passed on heard again with ``hear_signals``; ``captured``:
        :meth:`Forked.communicate` returns the files' text."""
        assert self.serves(env)
        request = {"module": module, "argv": argv, "env": env, "cwd": str(self.cwd),
                   "stdout": str(stdout), "stderr": str(stderr), "append": append,
                   "new_session": new_session, "hear_signals": hear_signals}
        run = Forked([sys.executable, "-m", module, *argv],
                     (stdout, stderr) if captured else None)
        with self._lock:
            request["id"] = self._next_id
            self._next_id += 1
            self._runs[request["id"]] = run
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
        if not run._started.wait(120):
            raise RuntimeError(f"the zygote did not fork in 120 s: {self.log.read_text()[-3000:]}")
        if run._error is not None:
            raise RuntimeError(run._error)
        return run

    def run(self, module: str, argv: list[str], env: dict[str, str], folder: Path,
            timeout: float) -> subprocess.CompletedProcess[str]:
        """``python -m module *argv`` in ``env``, as :func:`subprocess.run` with captured text
        output would return it; its outputs pass through files in ``folder``."""
        folder.mkdir(parents=True, exist_ok=True)
        run = self.start(module, argv, env, stdout=folder / "stdout.txt",
                         stderr=folder / "stderr.txt", captured=True)
        try:
            out, err = run.communicate(timeout)
        except subprocess.TimeoutExpired:
            run.kill()  # as subprocess.run does on a timeout
            out, err = run.communicate()
            raise subprocess.TimeoutExpired(run.args, timeout, out, err) from None
        return subprocess.CompletedProcess(run.args, run.returncode, out, err)

    def _read_replies(self) -> None:
        """The zygote's replies, each to its run: its pid at the fork, its status at its end."""
        for line in self._proc.stdout:
            reply = json.loads(line)
            with self._lock:
                run = self._runs[reply["id"]] if "pid" in reply else self._runs.pop(reply["id"])
            if "pid" in reply:
                run.pid = reply["pid"]
                run._started.set()
            else:
                run._end(reply["status"])
        try:
            said = self.log.read_text()[-3000:]
        except OSError:  # closed: its folder is gone
            said = ""
        error = f"the zygote ended (status {self._proc.wait()}): {said}"
        with self._lock:
            runs, self._runs = list(self._runs.values()), {}
        for run in runs:
            run._end(None, error)

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
