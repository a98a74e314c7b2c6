"""``trainkit sweep``: a hyperparameter search with Optuna, each trial a run of the entry point.

``trainkit sweep --trials 20 --jobs 2 +exp=mnist +sweep=lr`` composes the config as ``trainkit
train`` would, reads the search space from its ``sweep.params`` and the objective from
``checkpoint.monitor`` (direction from ``checkpoint.mode``), and runs each trial as its own
process, ``python -m trainkit.train <overrides> <the trial's values>``, in its own run dir
``<dir>/trial_<n>``. The study lives in ``<dir>/optuna.db`` (sqlite): several sweep commands
with the same ``--dir`` share it, and running the same command again continues it -- up to
``--trials`` completed trials, resuming trials a signal stopped from their checkpoints.

A trial's value is its run's last evaluation of the monitored metric (``summary.json``). A trial
that failed or was preempted is told to Optuna as failed: no value, nothing the sampler learns
from. Why not Hydra's Optuna sweeper: hydra-optuna-sweeper 1.3 requires optuna<3, and optuna 2.10
cannot create its sqlite storage beside SQLAlchemy 2 (MLflow's); so current Optuna is driven here
through its ask-and-tell interface.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainkit.core.errors import TrainkitError, command_name, one_line
from trainkit.core.signals import EXIT_PREEMPTED
from trainkit.observe.summary import read_summary

STUDY = "trainkit"  # one study per sweep dir: its database is the dir's own


@dataclass(frozen=True)
class SweepPlan:
    """What every trial of a sweep shares."""

    overrides: tuple[str, ...]  # the command's Hydra overrides, given to every trial
    space: dict[str, Any]  # config key -> optuna distribution
    monitor: str
    direction: str  # "maximize" or "minimize"


def read_plan(overrides: Sequence[str]) -> SweepPlan:
    """Compose the entry point's config with ``overrides``; read the search space and objective.

    Raises:
        TrainkitError: no search space, a range Optuna cannot draw from, no monitor, or a
            monitor that is not one of the run's evaluation metrics.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from trainkit.core.schema import config_dir, schema

    # the schema configs/train.yaml names, stored as trainkit.train stores it
    ConfigStore.instance().store(name="train_schema", node=schema())
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=list(overrides))
    params = OmegaConf.to_container(cfg.sweep, resolve=True).get("params") if cfg.sweep else None
    if not params:
        raise TrainkitError("no search space: add +sweep=lr (configs/sweep/lr.yaml) or your own "
                            "sweep.params, e.g. '+sweep.params={optim.lr: {low: 1e-4, high: "
                            "1e-1, log: true}}'")
    monitor, mode = cfg.checkpoint.monitor, cfg.checkpoint.mode
    reported = ["val/loss", *(f"val/{name}" for name in (cfg.get("metrics") or {}))]
    if not monitor:
        raise TrainkitError("the sweep needs an objective: set checkpoint.monitor to one of "
                            f"{', '.join(reported)} (and checkpoint.mode to max or min)")
    if monitor not in reported:
        raise TrainkitError(f"checkpoint.monitor={monitor!r} is not a metric the run reports: "
                            f"use one of {', '.join(reported)}")
    space = {key: _distribution(key, spec) for key, spec in params.items()}
    return SweepPlan(tuple(overrides), space, monitor, "maximize" if mode == "max" else "minimize")


def _distribution(key: str, spec: Any) -> Any:
    """``{low, high, log?, step?}`` (floats or integers) or ``{choices}`` as Optuna's."""
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    try:
        if isinstance(spec, Mapping) and set(spec) == {"choices"}:
            return CategoricalDistribution(list(spec["choices"]))
        if isinstance(spec, Mapping) and {"low", "high"} <= set(spec) <= {
                "low", "high", "log", "step"}:
            numbers = (spec["low"], spec["high"], spec.get("step") or 1)
            if all(isinstance(n, int) and not isinstance(n, bool) for n in numbers):
                return IntDistribution(**spec)
            return FloatDistribution(**spec)
    except (TypeError, ValueError) as err:
        raise TrainkitError(f"sweep.params.{key}: {one_line(err, 120)}") from None
    raise TrainkitError(f"sweep.params.{key}={spec!r}: give {{low, high}} (with log: true for a "
                        "log scale, or step) or {choices: [...]}")


def open_study(sweep_dir: Path, plan: SweepPlan, seed: int | None) -> Any:
    """The sweep dir's study, made on the first run and loaded on the next ones.

    Raises:
        TrainkitError: the study was begun with other overrides or another objective.
    """
    import optuna

    sweep_dir.mkdir(parents=True, exist_ok=True)
    storage = f"sqlite:///{(sweep_dir / 'optuna.db').absolute()}"
    study = optuna.create_study(storage=storage, study_name=STUDY, load_if_exists=True,
                                direction=plan.direction,
                                sampler=optuna.samplers.TPESampler(seed=seed))
    begun = {"overrides": list(plan.overrides), "monitor": plan.monitor}
    if not study.user_attrs:
        for name, value in begun.items():
            study.set_user_attr(name, value)
    elif {k: study.user_attrs.get(k) for k in begun} != begun:
        raise TrainkitError(f"{sweep_dir} holds a sweep begun with other settings "
                            f"({' '.join(study.user_attrs.get('overrides', []))}): give the same "
                            "ones to continue it, or another --dir for a new sweep")
    _resume_preempted(study)
    return study


def _resume_preempted(study: Any) -> None:
    """Queue again, with their values and run dirs, the trials a signal stopped: each resumes
    from its checkpoint. Once each: a trial queued already is not queued twice."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    queued = {t.user_attrs.get("resumes") for t in trials}
    for trial in trials:
        if (trial.state == TrialState.FAIL and trial.user_attrs.get("status") == "preempted"
                and trial.number not in queued):
            study.enqueue_trial(trial.params, user_attrs={
                "resumes": trial.number, "run_dir": trial.user_attrs["run_dir"]})


class Sweep:
    """Runs trials in ``jobs`` threads, each waiting on its trial's process."""

    def __init__(self, study: Any, plan: SweepPlan, sweep_dir: Path, trials: int) -> None:
        self.study, self.plan, self.sweep_dir, self.trials = study, plan, sweep_dir, trials
        self.stopping = threading.Event()  # a signal, or bad input: start no further trial
        self.bad_input: str | None = None
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen] = set()

    def run(self, jobs: int) -> int:
        """Run trials until ``trials`` are complete or running; return the exit status."""
        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(lambda _: self._worker(), range(jobs)))
        if self.bad_input is not None:
            print(f"trainkit: {self.bad_input}", file=sys.stderr)
            return 2
        return EXIT_PREEMPTED if self.stopping.is_set() else 0

    def forward(self, signum: int) -> None:
        """A signal to the sweep: its trials save and stop; no new one starts."""
        self.stopping.set()
        with self._lock:
            for proc in self._running:
                proc.send_signal(signum)

    def _next_trial(self) -> Any | None:
        from optuna.trial import TrialState

        with self._lock:  # counted and asked at once: no two threads take the last place
            if self.stopping.is_set():
                return None
            busy = self.study.get_trials(deepcopy=False,
                                         states=(TrialState.COMPLETE, TrialState.RUNNING))
            if len(busy) >= self.trials:
                return None
            return self.study.ask(self.plan.space)

    def _worker(self) -> None:
        while (trial := self._next_trial()) is not None:
            run_dir = trial.user_attrs.get("run_dir") or str(
                self.sweep_dir / f"trial_{trial.number:03d}")
            trial.set_user_attr("run_dir", run_dir)
            started = time.monotonic()
            status, detail = self._run_trial(trial, run_dir)
            self._tell(trial, status, detail, run_dir, time.monotonic() - started)

    def _run_trial(self, trial: Any, run_dir: str) -> tuple[int, str]:
        values = [f"{key}={value!r}" for key, value in trial.params.items()]
        command = [sys.executable, "-m", "trainkit.train", *self.plan.overrides, *values,
                   "hydra.run.dir='" + run_dir.replace("'", "\\'") + "'"]
        with self._lock:
            if self.stopping.is_set():
                return EXIT_PREEMPTED, "not started: the sweep was stopped"
            # In a session of its own: a Ctrl-C to the terminal's group reaches it once, as the
            # sweep forwards it, not twice (a second signal would abort the trial unsaved).
            proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    text=True, start_new_session=True)
            self._running.add(proc)
            # said at once: a trial may train for minutes before its line of results
            print(f"trial {trial.number} started: {_shown(trial.params)}  ({run_dir})",
                  flush=True)
        _, stderr = proc.communicate()
        with self._lock:
            self._running.discard(proc)
        last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
        return proc.returncode, last.removeprefix("trainkit: ")

    def _tell(self, trial: Any, status: int, detail: str, run_dir: str, seconds: float) -> None:
        from optuna.trial import TrialState

        shown = f"{_shown(trial.params)} after {seconds:.0f} s"
        summary = read_summary(run_dir) or {}
        value = (summary.get("metrics") or {}).get(self.plan.monitor)
        if status == 0 and summary.get("status") in ("completed", "stopped") and value is not None:
            self.study.tell(trial, float(value))
            print(f"trial {trial.number}: {shown} -> {self.plan.monitor} {value:.4f}  "
                  f"({run_dir})", flush=True)
            return
        if status == EXIT_PREEMPTED:
            trial.set_user_attr("status", "preempted")  # resumed by the next sweep command
            # the machine is likely going away (a scheduler signals all its processes)
            self.stopping.set()
            detail = "preempted: re-run the sweep command to resume it"
        elif status == 2 or status == 0:
            self.stopping.set()  # bad input: every trial would fail alike
            self.bad_input = f"trial {trial.number}: " + (
                detail if status == 2 else f"the run reports no {self.plan.monitor}")
        self.study.tell(trial, state=TrialState.FAIL)
        print(f"trial {trial.number}: {shown} -> failed (exit {status}): {detail}  ({run_dir})",
              flush=True)


def _shown(params: Mapping[str, Any]) -> str:
    """A trial's parameters as its lines show them: ``optim.lr=0.0123``."""
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in params.items())


def best_line(study: Any, monitor: str) -> str:
    """One line on the study's best trial, or on there being none yet."""
    from optuna.trial import TrialState

    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        return "no completed trial yet"
    best = study.best_trial
    return (f"best: trial {best.number}, {monitor} {best.value:.4f}, "
            f"{' '.join(f'{k}={v!r}' for k, v in best.params.items())}  "
            f"({best.user_attrs.get('run_dir')})")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the sweep's own flags; every other argument is an override for each trial."""
    parser = argparse.ArgumentParser(
        prog=command_name("trainkit.entry.sweep"),
        description="An Optuna search over `trainkit train` runs; the search space is the "
                    "config's sweep.params, the objective its checkpoint.monitor.")
    parser.add_argument("--trials", type=int, default=10,
                        help="completed trials the study should have (default 10)")
    parser.add_argument("--jobs", type=int, default=1, help="trials run at once (default 1)")
    parser.add_argument("--dir", type=Path, default=Path("sweeps/sweep"),
                        help="the sweep dir: optuna.db and a run dir per trial")
    parser.add_argument("--seed", type=int, default=None, help="the sampler's seed")
    args, overrides = parser.parse_known_args(argv)
    from trainkit.entry.errors import errors_as_one_line

    with errors_as_one_line():
        if args.trials < 1 or args.jobs < 1:
            raise TrainkitError("--trials and --jobs must be at least 1")
        _quiet_optuna()
        plan = read_plan(overrides)
        study = open_study(args.dir, plan, args.seed)
    sweep = Sweep(study, plan, args.dir, args.trials)
    before = {s: signal.signal(s, lambda signum, _: sweep.forward(signum))
              for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = sweep.run(args.jobs)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
    print(best_line(study, plan.monitor), flush=True)
    print(f"all runs: trainkit runs {args.dir}", flush=True)
    return status


def _quiet_optuna() -> None:
    """Optuna's own per-trial INFO lines repeat what the sweep prints."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)


if __name__ == "__main__":
    sys.exit(main())
