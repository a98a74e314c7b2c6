from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.fakes import write_fake_cifar10, write_fake_mnist
from tests.helpers.signals import hear_preemption_signals
from tests.helpers.zygote import Forked, Zygote
from trainkit.core.errors import LINE_LIMIT
from trainkit.core.signals import PREEMPTION_SIGNALS

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True, scope="session")
def _session_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """trainkit's cache (the record of verified dataset files) in the session's temporary
    folder, for this process and the ones the tests start, not in the user's ~/.cache."""
    before = os.environ.get("TRAINKIT_CACHE_DIR")
    os.environ["TRAINKIT_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if before is None:
        os.environ.pop("TRAINKIT_CACHE_DIR")
    else:
        os.environ["TRAINKIT_CACHE_DIR"] = before


@contextlib.contextmanager
def preemption_signals_heard() -> Iterator[None]:
    """:func:`hear_preemption_signals` in this process for a block, then as it was."""
    before = {signum: signal.getsignal(signum) for signum in PREEMPTION_SIGNALS}
    hear_preemption_signals()
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def last_checkpoint(run_dir: Path) -> dict:
    """``<run_dir>/checkpoints/last.pt``, loaded as users are told to load it."""
    return torch.load(Path(run_dir) / "checkpoints" / "last.pt", map_location="cpu",
                      weights_only=True)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """The same tensor names with bitwise equal values."""
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def sgd_without(model: torch.nn.Module, data: list, skipped: int, **sgd: float
                ) -> torch.nn.Module:
    """``model`` trained by the plain loop with ``SGD(**sgd)`` over ``data`` less batch
    ``skipped``: what a run that skips that step exactly ends with."""
    import torch.nn.functional as F

    optimizer = torch.optim.SGD(model.parameters(), **sgd)
    for i, (x, y) in enumerate(data):
        if i != skipped:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    return model


@pytest.fixture(scope="session")
def mnist_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data root with small, learnable MNIST-format files (not the official ones)."""
    return write_fake_mnist(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[Any]:
    """moto's S3 server over HTTP on a free port, one for the session, started by the first test
    that needs it (tests/helpers/s3.py); each module makes its own bucket."""
    from tests.helpers.s3 import moto_server

    with moto_server() as server:
        yield server


@pytest.fixture(scope="session")
def cifar_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data root with small, learnable CIFAR-10 files in the real python-pickle format."""
    return write_fake_cifar10(tmp_path_factory.mktemp("cifar"))


def error_report(stderr: str) -> tuple[list[str], str]:
    """A failed command's stderr as ``(detail lines, last line)``, checking its shape: indented
    details, then one ``trainkit:`` line of at most LINE_LIMIT characters, and no traceback."""
    assert "Traceback" not in stderr, stderr
    *details, last = [line for line in stderr.rstrip().splitlines() if line.strip()]
    assert last.startswith("trainkit: ") and len(last) <= LINE_LIMIT, last
    assert all(line.startswith("  ") for line in details), stderr
    return details, last


def offline_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess that must not reach the network.

    Proxies pointed at a closed local port make any download fail at once, here and on a
    machine that is online.
    """
    env = dict(os.environ)
    env.pop("TRAINKIT_DATA_DIR", None)
    dead = "http://127.0.0.1:9"
    env.update(http_proxy=dead, https_proxy=dead, HTTP_PROXY=dead, HTTPS_PROXY=dead,
               no_proxy="", NO_PROXY="", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


_zygotes: list[Zygote] = []  # this process's, started by the first run that can use it
# one per other environment a module's runs asked to fork in, and the session's zygote left
# behind when the test process's environment changed
_env_zygotes: list[Zygote] = []
_forked_runs = itertools.count()


@pytest.fixture(autouse=True, scope="session")
def _zygote_closed() -> Iterator[None]:
    """The session's zygote (:func:`run_module`), if one was started, ended with the session
    (an xdist worker's exit may skip atexit; the zygote would end at its stdin's close anyway,
    but leave its folder)."""
    yield
    while _zygotes:
        _zygotes.pop().close()


@pytest.fixture(autouse=True, scope="module")
def _env_zygotes_closed() -> Iterator[None]:
    """The zygotes of other environments (``fork``) end with the module that asked for them:
    its environments are its own (a bucket's address, a cache folder). So does a session zygote
    left behind, once the runs it started in the module have ended."""
    yield
    while _env_zygotes:
        _env_zygotes.pop().close()


def _zygote(env: dict[str, str] | None, fresh: bool, fork: bool) -> Zygote | None:
    """The zygote a run in ``env`` (None: :func:`offline_env`) is forked from, started on first
    use; None where the run starts a fresh interpreter."""
    run_env = env or offline_env()
    if fresh or (env is not None and not fork):
        return None
    if env is None:  # the session's own zygote, in the test process's environment as it is now
        if _zygotes and not _zygotes[0].serves(run_env):
            # The environment changed (torch sets variables of its own, as a compiled kernel's
            # load or elastic_launch does; a module sets its service's): a zygote imports in
            # the new one, and the old one ends with the module, after the runs it started.
            _env_zygotes.append(_zygotes.pop())
        if not _zygotes:
            _zygotes.append(_new_zygote(run_env))
        return _zygotes[0]
    zygote = next((z for z in _zygotes + _env_zygotes if z.serves(run_env)), None)
    if zygote is None:
        zygote = _new_zygote(run_env)
        _env_zygotes.append(zygote)
    return zygote


def _new_zygote(env: dict[str, str]) -> Zygote:
    folder = Path(tempfile.gettempdir()) / f"trainkit-runs-{os.getpid()}-{next(_forked_runs)}"
    return Zygote(env, REPO, folder / "zygote.err")


def run_module(module: str, *args: str, env: dict[str, str] | None = None,
               timeout: float = 300, fresh: bool = False,
               fork: bool = False) -> subprocess.CompletedProcess[str]:
    """``python -m module *args`` from the repository, in a process of its own, its output
    captured as text.

    In the default environment (:func:`offline_env`) the process is forked from a zygote that
    has imported trainkit, torch and Hydra already (tests/helpers/zygote.py: an interpreter and
    those imports are ~4 CPU s, most of a few-step run's cost); ``fresh`` (or any other ``env``)
    starts a new interpreter, for a test of what a start does. ``fork`` forks a run in another
    ``env`` too, from a zygote started in that env (one start for the module's runs in it)."""
    run_env = env or offline_env()
    zygote = _zygote(env, fresh, fork)
    if zygote is not None:
        return zygote.run(module, list(args), run_env, zygote.log.parent / str(
            next(_forked_runs)), timeout)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=run_env,
                          capture_output=True, text=True, timeout=timeout)


Started = subprocess.Popen | Forked  # what start_module returns


def start_module(module: str, *args: str, out: Path | None = None,
                 env: dict[str, str] | None = None, new_session: bool = False,
                 fresh: bool = False) -> Started:
    """``python -m module *args`` started and not waited for, as :class:`subprocess.Popen`
    with its preemption signals heard (:func:`hear_preemption_signals`), forked from a zygote
    as :func:`run_module`'s runs are (in ``env`` too: the module's runs share one zygote).
    Its output and errors go to ``out`` (appended), or are captured: ``communicate()`` returns
    them as text. ``new_session``: the leader of a session of its own, as with ``setsid``."""
    run_env = env or offline_env()
    zygote = _zygote(env, fresh, fork=True)
    if zygote is not None:
        stdout = stderr = out
        if out is None:
            folder = zygote.log.parent / str(next(_forked_runs))
            folder.mkdir(parents=True)
            stdout, stderr = folder / "stdout.txt", folder / "stderr.txt"
        return zygote.start(module, list(args), run_env, stdout=stdout, stderr=stderr,
                            append=out is not None, new_session=new_session,
                            hear_signals=True, captured=out is None)
    command = [sys.executable, "-m", module, *args]
    if out is None:
        return subprocess.Popen(command, cwd=REPO, env=run_env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                preexec_fn=hear_preemption_signals,
                                start_new_session=new_session)
    with open(out, "ab") as stream:  # the child has its own copy
        return subprocess.Popen(command, cwd=REPO, env=run_env, stdout=stream,
                                stderr=subprocess.STDOUT, preexec_fn=hear_preemption_signals,
                                start_new_session=new_session)


def run_train(*overrides: str, env: dict[str, str] | None = None, timeout: float = 300,
              fresh: bool = False, fork: bool = False) -> subprocess.CompletedProcess[str]:
    """Run the real entry point, ``python -m trainkit.train``, in a process of its own
    (:func:`run_module`)."""
    return run_module("trainkit.train", *overrides, env=env, timeout=timeout, fresh=fresh,
                      fork=fork)


def run_train_many(runs: dict[str, list[str]], folder: Path,
                   timeout: float = 600) -> dict[str, subprocess.CompletedProcess[str]]:
    """Each run of ``runs`` (name: the entry point's arguments) as :func:`run_train` would return
    it, all in one process (tests/helpers/entry_runs.py: one interpreter, torch and Hydra start
    instead of one a run): for runs of bad input that end before training. Outputs go to
    ``folder/<name>.{status,out,err}``."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = [{"argv": argv, "prefix": str(folder / name)} for name, argv in runs.items()]
    (folder / "runs.json").write_text(json.dumps(spec))
    done = run_module("tests.helpers.entry_runs", str(folder / "runs.json"), timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return {name: subprocess.CompletedProcess(
        argv, int((folder / f"{name}.status").read_text()),
        (folder / f"{name}.out").read_text(), (folder / f"{name}.err").read_text())
        for name, argv in runs.items()}


def tiny_run(run_dir: Path, data_root: Path, *extra: str) -> list[str]:
    """Overrides for a few-step MNIST run on the fake files, in precision 32 unless ``extra``
    sets another (the later of two values of a key wins)."""
    return [
        "+exp=mnist", f"hydra.run.dir={run_dir}", f"data.root={data_root}",
        "data.verify=false", "data.download=false", "data.batch_size=32",
        "data.eval_batch_size=64", "trainer.log_every_n_steps=2", "trainer.precision=32", *extra,
    ]


@pytest.fixture(scope="session")
def real_mnist_root() -> Path:
    """The real MNIST under TRAINKIT_DATA_DIR; the test is skipped where there is none."""
    root = os.environ.get("TRAINKIT_DATA_DIR")
    if not root or not (Path(root) / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").is_file():
        pytest.skip("real MNIST not found under TRAINKIT_DATA_DIR")
    return Path(root)


def start_in_own_group(command: list[str], out: Path) -> subprocess.Popen:
    """Start ``command`` as the leader of a new session and process group (``setsid``), hearing
    the preemption signals as when started from a terminal; its output goes to ``out``."""
    with open(out, "ab") as stream:  # the child has its own copy
        return subprocess.Popen(command, cwd=REPO, env=offline_env(TRAINKIT_DIST_TIMEOUT_S="60"),
                                stdout=stream, stderr=subprocess.STDOUT,
                                preexec_fn=hear_preemption_signals, start_new_session=True)


def pause_at(step: int, marker: Path) -> tuple[str, ...]:
    """Overrides that make a run wait at the end of step ``step`` for a signal, once it has
    written ``marker`` (``{rank}`` in it becomes each rank's number): see tests/helpers/pause.py.
    """
    return ("+callbacks.pause._target_=tests.helpers.pause.PauseAt",
            f"+callbacks.pause.step={step}", f"+callbacks.pause.marker='{marker}'")


def wait_for_pause(proc: subprocess.Popen, marker: Path, ranks: int = 1,
                   timeout: float = 240) -> list[int]:
    """Block until every rank's ``marker`` exists (its process waits there for a signal);
    their pids. The deadline only ends a failing test."""
    paths = [Path(str(marker).replace("{rank}", str(rank))) for rank in range(ranks)]
    deadline = time.monotonic() + timeout
    while not all(path.is_file() for path in paths):
        assert proc.poll() is None, f"the run ended (status {proc.returncode}) before the pause"
        assert time.monotonic() < deadline, f"no pause at {marker} in time"
        time.sleep(0.02)
    return [int(path.read_text()) for path in paths]
