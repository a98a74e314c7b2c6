"""Experiment trackers as metrics sinks: :class:`MLflowSink` and :class:`WandbSink`.

Each records, from rank 0: the run's resolved config as parameters (flattened keys,
``trainer.max_steps``), every scalar the loop logs at its step under TensorBoard's names
(``train/loss``, ``val/acc``, ...), the run directory's path, and at the end the run's status
and ``summary.json``. The tracker's run id is kept in ``<run_dir>/trackers/<name>.json``: a
resumed or extended run (the same command again) appends to the same tracker run.

A tracker talks to a server, so its calls run in order on a thread of their own and the loop
never waits for one: a slow or unreachable server costs the training nothing. The first call
that fails is one warning line in ``train.log``; the tracker is then off for the rest of the run
(``metrics.jsonl`` has every metric). ``close`` waits up to ``close_timeout_s`` for the calls
still queued, so a preempted run's last metrics and status reach the tracker before it exits.

mlflow and wandb are imported on that thread when the run starts, never by ``import trainkit``;
each is an optional extra: ``pip install "trainkit[mlflow]"``, ``"trainkit[wandb]"``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trainkit.config import flatten
from trainkit.errors import ConfigError
from trainkit.observe.sinks import remember_tracker_run, tracker_runs, warn_failed

__all__ = ["MLflowSink", "WandbSink"]
log = logging.getLogger("trainkit")

# summary.json's status -> MLflow's run status (a preempted run is resumed later: KILLED)
_MLFLOW_STATUS = {"completed": "FINISHED", "stopped": "FINISHED", "preempted": "KILLED"}
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

    Args:
        tracking_uri: where runs go: a server (``http://host:5000``), a database
            (``sqlite:///mlflow.db``) or a folder (``file:./mlruns``); None: MLflow's own
            default (``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db`` in MLflow 3).
            MLflow 3 keeps the folder store only behind ``MLFLOW_ALLOW_FILE_STORE=true``;
            naming a ``file:`` store here sets that for this process.
        experiment: the experiment's name (made when missing).
        run_name: the run's name; None: the run directory's name.
        tags: more tags for the run.
        send_every_s: the logging steps of this many seconds go to MLflow in one batch (the
            end of the run sends what is left); 0: each at once.
        close_timeout_s: how long the end of the run waits for calls still queued.

    Example:
        >>> Trainer(config, run_dir="runs/a",
        ...         sinks=[MLflowSink("sqlite:///mlflow.db")])  # doctest: +SKIP
    """

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
        self._calls = _Calls("MLflowSink")
        self.run_id: str | None = None  # once started
        self._client: Any = None
        self._seen: dict[str, int] = {}  # a resumed run: the last step of each metric logged
        self._ended = False
        # logging steps not sent yet: few, large batches cost the training thread least (each
        # call wakes this sink's thread, which then competes for the GIL)
        self._pending: list[tuple[dict[str, float], int, int]] = []
        self._lock = threading.Lock()
        self._next_send = 0.0  # time.time() of the next send
        self._queued = False  # a send is in the queue

    def start(self, run_dir: Path | None, config: Mapping[str, Any]) -> None:
        with self._lock:  # a previous fit's, left by a tracker that failed
            self._pending, self._queued, self._next_send = [], False, 0.0
        self._calls.put(self._start, run_dir, dict(config))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._calls.failed:
            return
        now = time.time()
        with self._lock:
            self._pending.append((dict(metrics), step, int(now * 1000)))
            if self._queued or now < self._next_send:
                return  # a send queued already takes it, or a later one will
            self._queued, self._next_send = True, now + self.send_every_s
        self._calls.put(self._send)

    def finish(self, status: str, summary: Mapping[str, Any]) -> None:
        self._calls.put(self._finish, status, dict(summary))

    def close(self) -> None:
        if not self._calls.failed:
            self._calls.put(self._end, "FAILED")  # nothing, after finish(); else the run failed
        self._calls.close(self.close_timeout_s)

    # -- on the tracker's thread --------------------------------------------------------------

    def _start(self, run_dir: Path | None, config: dict[str, Any]) -> None:
        if self.tracking_uri and self.tracking_uri.startswith("file:"):
            # MLflow 3 refuses a folder store unless asked for it; naming one here is asking
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        client = self._client = MlflowClient(tracking_uri=self.tracking_uri)
        self._seen, self._ended = {}, False  # a sink may serve several fits, one run each
        uri = self.tracking_uri or client.tracking_uri
        kept = tracker_runs(run_dir).get("mlflow", {})
        run = None
        if kept.get("tracking_uri") == uri and kept.get("run_id"):
            run = self._resume(kept["run_id"])
        if run is None:
            run = client.create_run(self._experiment_id(), run_name=self.run_name or (
                run_dir.name if run_dir else None), tags=self._run_tags(run_dir))
        self.run_id = run.info.run_id
        remember_tracker_run(run_dir, "mlflow", {"tracking_uri": uri,
                                                 "experiment_id": run.info.experiment_id,
                                                 "run_id": self.run_id})
        self._log_params(run.data.params, config)

    def _resume(self, run_id: str) -> Any:
        """The kept run, running again, and the last step of each of its metrics; None if gone."""
        from mlflow.exceptions import MlflowException

        client = self._client
        try:
            run = client.get_run(run_id)
        except MlflowException:  # deleted, or another store: this run starts a new one
            log.info("MLflow run %s is not in this store; starting a new one", run_id)
            return None
        client.update_run(run_id, status="RUNNING")
        # A run resumed from a checkpoint before its last logging steps replays them: those
        # are logged once (identical with an exact resume), not twice.
        self._seen = {key: max(m.step for m in client.get_metric_history(run_id, key))
                      for key in run.data.metrics}
        return run

    def _experiment_id(self) -> str:
        client = self._client
        found = client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        from mlflow.exceptions import MlflowException

        try:
            return client.create_experiment(self.experiment)
        except MlflowException:  # another run made it meanwhile
            return client.get_experiment_by_name(self.experiment).experiment_id

    def _run_tags(self, run_dir: Path | None) -> dict[str, str]:
        tags = dict(self.tags)
        if run_dir is not None:
            tags["trainkit.entry.run_dir"] = str(run_dir.resolve())
        return tags

    def _log_params(self, logged: Mapping[str, str], config: Mapping[str, Any]) -> None:
        """The config's leaves as params; a resumed run adds only keys its run has not."""
        from mlflow.entities import Param

        params = [Param(key, str(value)[:6000]) for key, value in flatten(config).items()
                  if key not in logged]  # MLflow refuses to change a param's value
        for i in range(0, len(params), 100):  # MLflow's limit per batch
            self._client.log_batch(self.run_id, params=params[i:i + 100])

    def _send(self) -> None:
        from mlflow.entities import Metric

        with self._lock:
            pending, self._pending, self._queued = self._pending, [], False
        seen = self._seen
        batch = [Metric(key, float(value), timestamp, step)
                 for metrics, step, timestamp in pending for key, value in metrics.items()
                 if not seen or step > seen.get(key, -1)]
        for i in range(0, len(batch), 1000):  # MLflow's limit per batch
            self._client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def _finish(self, status: str, summary: dict[str, Any]) -> None:
        client = self._client
        client.set_tag(self.run_id, "trainkit.status", status)
        client.log_dict(self.run_id, summary, "summary.json")
        self._end(_MLFLOW_STATUS.get(status, "FAILED"))

    def _end(self, mlflow_status: str) -> None:
        if self.run_id is not None and not self._ended:
            self._send()  # what the send interval held back
            self._client.set_terminated(self.run_id, status=mlflow_status)
            self._ended = True


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
