"""The process that talks to MLflow for :class:`trainkit.MLflowSink` (no torch, no trainkit).

MLflow's client is pure Python whose CPU, on a thread of the training process, held the training
thread's GIL (benchmarks/README.md): it runs here instead, started by the sink through ``python
-c`` and :func:`runpy.run_path` (neither torch nor trainkit imported), in a session of its own
out of reach of the job's signals, so a preempted run's last metrics still get out. Its stdin
takes one JSON line per event: ``{"start": {...}}`` (URI, experiment, names, tags, params, the run
to resume), ``{"log": [metrics, step, time_ms]}``, ``{"finish": [status, summary]}``, ``{"close":
true}``. Its stdout answers ``{"run": {...}}`` once the run exists, ``{"note": "..."}`` for
``train.log`` and ``{"failed": "Type: message"}`` at its first error (it then only reads on).
``close`` or the end of its input ends the MLflow run: FAILED when no ``finish`` came.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

# The sink's last line. Its end of input alone would not do: DataLoader workers forked from the
# training process hold the pipe's write end open for as long as they live.
CLOSE = '{"close": true}\n'
# summary.json's status -> MLflow's run status (a preempted run is resumed later: KILLED)
_MLFLOW_STATUS = {"completed": "FINISHED", "stopped": "FINISHED", "preempted": "KILLED"}


class Tracker:
    """One MLflow run: made or reopened by :meth:`start`, ended by :meth:`end`."""

    def __init__(self, start: dict[str, Any]) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=start["tracking_uri"])
        self.send_every_s = float(start["send_every_s"])
        self.pending: list[Any] = []  # logging steps not sent yet: few, large batches
        self.next_send = 0.0
        self.seen: dict[str, int] = {}  # a resumed run: the last step of each metric logged
        self.run_id: str | None = None
        self.ended = False
        self._start(start)

    def _start(self, start: dict[str, Any]) -> None:
        client = self.client
        uri = start["tracking_uri"] or client.tracking_uri
        kept = start["kept"]
        run = None
        if kept.get("tracking_uri") == uri and kept.get("run_id"):
            run = self._resume(kept["run_id"])
        if run is None:
            run = client.create_run(self._experiment_id(start["experiment"]),
                                    run_name=start["run_name"], tags=start["tags"])
        self.run_id = run.info.run_id
        _answer({"run": {"tracking_uri": uri, "experiment_id": run.info.experiment_id,
                         "run_id": self.run_id}})
        self._log_params(run.data.params, start["params"])

    def _resume(self, run_id: str) -> Any:
        """The kept run, running again, and the last step of each of its metrics; None if gone."""
        from mlflow.exceptions import MlflowException

        client = self.client
        try:
            run = client.get_run(run_id)
        except MlflowException:  # deleted, or another store: this run starts a new one
            _answer({"note": f"MLflow run {run_id} is not in this store; starting a new one"})
            return None
        client.update_run(run_id, status="RUNNING")
        # A run resumed from a checkpoint before its last logging steps replays them: those
        # are logged once (identical with an exact resume), not twice.
        self.seen = {key: max(m.step for m in client.get_metric_history(run_id, key))
                     for key in run.data.metrics}
        return run

    def _experiment_id(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except MlflowException:  # another run made it meanwhile
            return self.client.get_experiment_by_name(name).experiment_id

    def _log_params(self, logged: dict[str, str], params: dict[str, str]) -> None:
        """The config's leaves as params; a resumed run adds only keys its run has not."""
        from mlflow.entities import Param

        new = [Param(key, value) for key, value in params.items()
               if key not in logged]  # MLflow refuses to change a param's value
        for i in range(0, len(new), 100):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, params=new[i:i + 100])

    def log(self, metrics: dict[str, float], step: int, time_ms: int) -> None:
        self.pending.append((metrics, step, time_ms))
        if time.monotonic() >= self.next_send:
            self.send()
            self.next_send = time.monotonic() + self.send_every_s

    def send(self) -> None:
        from mlflow.entities import Metric

        pending, self.pending = self.pending, []
        seen = self.seen
        batch = [Metric(key, float(value), time_ms, step)
                 for metrics, step, time_ms in pending for key, value in metrics.items()
                 if not seen or step > seen.get(key, -1)]
        for i in range(0, len(batch), 1000):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def finish(self, status: str, summary: dict[str, Any]) -> None:
        self.client.set_tag(self.run_id, "trainkit.status", status)
        self.client.log_dict(self.run_id, summary, "summary.json")
        self.end(_MLFLOW_STATUS.get(status, "FAILED"))

    def end(self, mlflow_status: str) -> None:
        if not self.ended:
            self.send()  # what the send interval held back
            self.client.set_terminated(self.run_id, status=mlflow_status)
            self.ended = True


def _answer(message: dict[str, Any]) -> None:
    try:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()
    except OSError:  # the training process is gone: nobody to tell
        pass


def main() -> None:
    tracker: Tracker | None = None
    failed = False
    for line in sys.stdin:
        if not line.endswith("\n"):
            break  # the training process died while writing this line: the input has ended
        if line == CLOSE:
            break
        if failed:
            continue  # read on: the training process never waits on a full pipe
        try:
            message = json.loads(line)
            if "start" in message:
                tracker = Tracker(message["start"])
            elif "log" in message:
                tracker.log(*message["log"])
            elif "finish" in message:
                tracker.finish(*message["finish"])
        except Exception as err:  # a tracker never takes a run down: say so once, then drain
            failed = True
            _answer({"failed": f"{type(err).__name__}: {err}"})
    if tracker is not None and not failed:
        try:
            tracker.end("FAILED")  # nothing after finish(); else the training process died
        except Exception as err:
            _answer({"failed": f"{type(err).__name__}: {err}"})


if __name__ == "__main__":
    main()
