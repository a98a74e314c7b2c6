"""Experiment trackers as metrics sinks: :class:`MLflowSink` and :class:`WandbSink`.

Each records, from rank 0, the resolved config as parameters, every logged scalar at its step
under TensorBoard's names, and at the end the status and ``summary.json``; the tracker's run id
in ``<run_dir>/trackers/<name>.json`` lets a resumed run append to the same tracker run. The loop
never waits for a server: MLflow runs in a process of its own, W&B's calls on a thread. The
first failed call is one warning in ``train.log`` and turns the tracker off (``metrics.jsonl``
has every metric); ``close`` waits up to ``close_timeout_s``, so a preempted run's last metrics
get out. mlflow and wandb are optional extras (``pip install "trainkit[mlflow]"``), imported
when the run starts, never by ``import trainkit``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import queue
import select
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trainkit.config import flatten
from trainkit.core.errors import ConfigError
from trainkit.observe.mlflow_process import CLOSE
from trainkit.observe.sinks import remember_tracker_run, tracker_runs, warn_failed

__all__ = ["MLflowSink", "WandbSink"]
log = logging.getLogger("trainkit")

_EXIT_CODES = {"completed": 0, "stopped": 0, "preempted": 75}  # W&B: else 1 (failed)


def _require(module: str, sink: str, extra: str) -> None:
    """One line naming the extra to install when ``module`` is missing (it is not imported)."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f'{sink} needs {module}, which is not installed: '
                          f'pip install "trainkit[{extra}]"')


class _Calls:
    """A tracker's calls, run in order on one daemon thread; the first error turns it off."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]] | None] = (
            queue.SimpleQueue())
        self._thread: threading.Thread | None = None
        self.failed = False

    def put(self, call: Callable[..., None], *args: Any) -> None:
        if self._thread is None:  # daemon: a server that never answers cannot hold the exit
            self._thread = threading.Thread(target=self._work, name=f"trainkit-{self.name}",
                                            daemon=True)
            self._thread.start()
        self._queue.put((call, args))

    def close(self, timeout: float) -> None:
        """Run what is queued (for up to ``timeout`` seconds), then end the thread.

        A later ``put`` (the sink's next fit) starts a new thread, errors forgotten.
        """
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._queue.put(None)
        thread.join(timeout)
        if thread.is_alive():
            if not self.failed:
                warn_failed(self.name, TimeoutError(f"its calls took over {timeout:g} s; the "
                                                    "rest are left behind"))
            self._queue = queue.SimpleQueue()  # the stuck thread keeps the old one
        self.failed = False

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            call, args = item
            if self.failed:
                continue  # drain: put() never blocks
            try:
                call(*args)
            except BaseException as err:  # no signal reaches this thread; SystemExit from a lib
                self.failed = True
                warn_failed(self.name, err)


class MLflowSink:
    """Logs the run to MLflow: params, metrics by step, tags, ``summary.json`` as an artifact.

    MLflow's client runs in a process of its own (:mod:`trainkit.observe.mlflow_process`), so
    its CPU never holds the training thread's GIL: a logging step costs one JSON line written
    to its pipe, without waiting.

    Args:
        tracking_uri: where runs go: a server (``http://host:5000``), a database
            (``sqlite:///mlflow.db``) or a folder (``file:./mlruns``); None: MLflow's own
            default (``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db`` in MLflow 3).
            MLflow 3 keeps the folder store only behind ``MLFLOW_ALLOW_FILE_STORE=true``;
            naming a ``file:`` store here sets that for the sink's process.
        experiment: the experiment's name (made when missing).
        run_name: the run's name; None: the run directory's name.
        tags: more tags for the run.
        send_every_s: the logging steps of this many seconds go to MLflow in one batch (the
            end of the run sends what is left); 0: each at once.
        close_timeout_s: how long the end of the run waits for the sink's process to finish.

    Example:
        >>> Trainer(config, run_dir="runs/a",
        ...         sinks=[MLflowSink("sqlite:///mlflow.db")])  # doctest: +SKIP
    """

    name = "MLflowSink"

    def __init__(self, tracking_uri: str | None = None, experiment: str = "trainkit",
                 run_name: str | None = None, tags: Mapping[str, str] | None = None,
                 send_every_s: float = 2.0, close_timeout_s: float = 30.0) -> None:
        _require("mlflow", "MLflowSink", "mlflow")
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.tags = dict(tags or {})
        self.send_every_s = send_every_s
        self.close_timeout_s = close_timeout_s
        self.run_id: str | None = None  # once the process has made (or reopened) the run
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._unsent = bytearray()  # lines the pipe had no room for yet
        self._failed = False

    def start(self, run_dir: Path | None, config: Mapping[str, Any]) -> None:
        self.close()  # a sink may serve several fits, one MLflow run each
        self.run_id, self._failed = None, False
        env = dict(os.environ)
        if self.tracking_uri and self.tracking_uri.startswith("file:"):
            # MLflow 3 refuses a folder store unless asked for it; naming one here is asking
            env.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        script = Path(__file__).with_name("mlflow_process.py")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "import runpy, sys; runpy.run_path(sys.argv[1], "
             "run_name='__main__')", str(script)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
            start_new_session=True)  # a signal to the job's group must not stop it before close
        os.set_blocking(self._proc.stdin.fileno(), False)  # the loop never waits on MLflow
        self._reader = threading.Thread(target=self._read, args=(self._proc, run_dir),
                                        name="trainkit-MLflowSink", daemon=True)
        self._reader.start()
        tags = dict(self.tags)
        if run_dir is not None:
            tags["trainkit.entry.run_dir"] = str(run_dir.resolve())
        self._send({"start": {
            "tracking_uri": self.tracking_uri, "experiment": self.experiment,
            "run_name": self.run_name or (run_dir.name if run_dir else None), "tags": tags,
            "params": {key: str(value)[:6000] for key, value in flatten(config).items()},
            "kept": tracker_runs(run_dir).get("mlflow", {}), "send_every_s": self.send_every_s}})

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        values = {key: float(value) for key, value in metrics.items()}
        self._send({"log": [values, step, int(time.time() * 1000)]})

    def finish(self, status: str, summary: Mapping[str, Any]) -> None:
        self._send({"finish": [status, dict(summary)]})

    def close(self) -> None:
        """Send what is left and the last line (which ends the MLflow run), then wait up to
        ``close_timeout_s`` for the process; one still busy then is stopped, with a warning."""
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        self._unsent += CLOSE.encode()  # also after a failure: the process reads until this line
        deadline = time.monotonic() + self.close_timeout_s
        while self._unsent and time.monotonic() < deadline:
            select.select([], [proc.stdin], [], max(0.0, deadline - time.monotonic()))
            self._write(proc)
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            self._fail(f"TimeoutError: its calls took over {self.close_timeout_s:g} s; the "
                       "rest are left behind")
        if self._reader is not None:
            self._reader.join(timeout=5)  # its stdout ends with it (unless a child of its own
            # holds it open)
        if proc.returncode and not self._failed:
            self._fail(f"ChildProcessError: its process exited with status {proc.returncode}")
        self._unsent.clear()

    def _send(self, message: dict[str, Any]) -> None:
        if self._proc is None or self._failed:
            return
        self._unsent += (json.dumps(message, default=str) + "\n").encode()
        self._write(self._proc)

    def _write(self, proc: subprocess.Popen[bytes]) -> None:
        """As much of what is unsent as the pipe takes now; the rest waits for the next call."""
        try:
            written = os.write(proc.stdin.fileno(), self._unsent)
        except BlockingIOError:  # the pipe is full: MLflow is behind, training is not
            return
        except OSError as err:  # the process is gone (it said why on stdout, or it crashed)
            self._fail(f"{type(err).__name__}: {err}")
            self._unsent.clear()  # nothing more can reach it
            return
        del self._unsent[:written]

    def _read(self, proc: subprocess.Popen[bytes], run_dir: Path | None) -> None:
        """The process's answers: the MLflow run once it exists, or its first error."""
        for line in proc.stdout:
            with contextlib.suppress(ValueError):
                answer = json.loads(line)
                if "run" in answer:
                    self.run_id = answer["run"]["run_id"]
                    remember_tracker_run(run_dir, "mlflow", answer["run"])
                elif "failed" in answer:
                    self._fail(answer["failed"])
                elif "note" in answer:
                    log.info("%s", answer["note"])

    def _fail(self, reason: str) -> None:
        if not self._failed:
            self._failed = True
            warn_failed(self.name, reason)


class WandbSink:
    """Logs the run to Weights & Biases: config, metrics by step, summary, run state.

    The run id is chosen when the run starts and kept in ``<run_dir>/trackers/wandb.json``;
    a resumed run calls ``wandb.init(id=<that id>, resume="allow")``. The run directory's path
    is in the config as ``trainkit.entry.run_dir`` (W&B tags are short labels).

    Args:
        project: the W&B project.
        entity: the team or user; None: your default entity.
        name: the run's display name; None: the run directory's name.
        group, tags, notes: as in ``wandb.init``.
        mode: ``online``, ``offline`` or ``disabled``; None: ``WANDB_MODE`` or online.
        dir: where W&B writes its files; None: ``WANDB_DIR`` or ``./wandb``.
        settings: more ``wandb.Settings`` fields; trainkit sets ``console="off"`` (train.log
            has the console already) unless you set it.
        close_timeout_s: how long the end of the run waits for W&B to finish.
    """

    def __init__(self, project: str = "trainkit", entity: str | None = None,
                 name: str | None = None, group: str | None = None,
                 tags: list[str] | None = None, notes: str | None = None,
                 mode: str | None = None, dir: str | None = None,
                 settings: Mapping[str, Any] | None = None, close_timeout_s: float = 60.0) -> None:
        _require("wandb", "WandbSink", "wandb")
        self.init_args = {"project": project, "entity": entity, "name": name, "group": group,
                          "tags": list(tags or []) or None, "notes": notes, "mode": mode,
                          "dir": dir}
        self.settings = {"console": "off", **(settings or {})}
        self.close_timeout_s = close_timeout_s
        self._calls = _Calls("WandbSink")
        self.run_id: str | None = None
        self._run: Any = None
        self._first_step = 0  # steps below it are in the resumed W&B run already

    def start(self, run_dir: Path | None, config: Mapping[str, Any]) -> None:
        kept = tracker_runs(run_dir).get("wandb", {})
        same = (kept.get("project"), kept.get("entity")) == (self.init_args["project"],
                                                             self.init_args["entity"])
        self.run_id = kept["id"] if same and kept.get("id") else uuid.uuid4().hex[:12]
        # kept now, not when W&B answers: the run's first checkpoint names it already
        remember_tracker_run(run_dir, "wandb", {"project": self.init_args["project"],
                                                "entity": self.init_args["entity"],
                                                "id": self.run_id})
        self._calls.put(self._start, run_dir, dict(config))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._calls.put(self._log, dict(metrics), step)

    def finish(self, status: str, summary: Mapping[str, Any]) -> None:
        self._calls.put(self._finish, status, dict(summary))

    def close(self) -> None:
        if not self._calls.failed:
            self._calls.put(self._end, 1)  # nothing, after finish(); else the run failed
        self._calls.close(self.close_timeout_s)

    # -- on the tracker's thread --------------------------------------------------------------

    def _start(self, run_dir: Path | None, config: dict[str, Any]) -> None:
        import wandb

        args = dict(self.init_args)
        args["name"] = args["name"] or (run_dir.name if run_dir else None)
        run = self._run = wandb.init(**args, id=self.run_id, resume="allow",
                                     settings=wandb.Settings(**self.settings))
        self._first_step = run.step  # 0, or where the resumed run had got to
        flat = flatten(config)
        if run_dir is not None:
            flat["trainkit.entry.run_dir"] = str(run_dir.resolve())
        run.config.update(flat, allow_val_change=True)  # an extended run changes max_steps

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if step >= self._first_step:  # W&B drops (with a warning) steps below its own
            self._run.log(metrics, step=step)

    def _finish(self, status: str, summary: dict[str, Any]) -> None:
        run = self._run
        run.summary.update({"status": status, "summary": summary})
        if status == "preempted":
            run.mark_preempting()  # shown as preempted, not crashed, until it is resumed
        self._end(_EXIT_CODES.get(status, 1))

    def _end(self, exit_code: int) -> None:
        if self._run is not None:
            self._run.finish(exit_code=exit_code)
            self._run = None
