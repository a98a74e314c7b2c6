"""``trainkit sweep`` (Optuna, each trial a run of the entry point) and ``trainkit runs`` (a table
of run dirs), run as the README shows them; Hydra's submitit launcher with the entry point."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, error_report, offline_env
from tests.integration.test_doc_recipes import README, bash_block


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


needs_optuna = pytest.mark.skipif(not installed("optuna"),
                                  reason="optuna not installed: pip install 'trainkit[sweep]'")
# 3 steps of 32: a few seconds a trial, and accuracies that differ with the learning rate
FEW_STEPS = ("data.verify=false", "data.download=false", "data.batch_size=32",
             "data.eval_batch_size=128", "trainer.max_steps=3", "trainer.precision=32")


def trainkit(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The console command ``trainkit`` of this environment, in ``cwd``."""
    command = [str(Path(sys.executable).with_name("trainkit")), *args]
    return subprocess.run(command, cwd=cwd, env=offline_env(PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=timeout)


def readme_command(marker: str) -> list[str]:
    line = next(line for line in bash_block(README, marker).splitlines() if marker in line)
    return line.split("#")[0].split()[1:]  # without `trainkit` and the comment


@needs_optuna
@pytest.mark.slow
def test_readme_sweep_trains_each_trial_and_runs_lists_them_best_first(
        tmp_path: Path, mnist_root: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from trainkit.entry.sweep import main as sweep_main

    sweep = readme_command("trainkit sweep")
    assert "+sweep=lr" in sweep and "+exp=mnist" in sweep
    extra = ["--trials", "3", "--seed", "0", f"data.root={mnist_root}", *FEW_STEPS]
    done = trainkit(*sweep, *extra, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    sweep_dir = tmp_path / "sweeps" / "lr"
    trials = sorted(p for p in sweep_dir.iterdir() if p.is_dir())
    assert [p.name for p in trials] == [f"trial_{n:03d}" for n in range(3)]
    for trial in trials:
        assert json.loads((trial / "summary.json").read_text())["status"] == "completed"
        lr = yaml.safe_load((trial / ".hydra" / "config.yaml").read_text())["optim"]["lr"]
        assert 1e-4 <= lr <= 1e-1

    shown = trainkit(*readme_command("trainkit runs"), "--csv", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    rows = list(csv.DictReader(io.StringIO(shown.stdout)))
    assert sorted(row["run"] for row in rows) == [p.name for p in trials]
    # best first; runs with equal accuracies (a tie) in the order of their names
    accs = [float(row["val/acc"]) for row in rows]
    assert [(-a, row["run"]) for a, row in zip(accs, rows)] == sorted(
        (-a, row["run"]) for a, row in zip(accs, rows))
    best = sweep_dir / rows[0]["run"]
    summary = json.loads((best / "summary.json").read_text())
    config = yaml.safe_load((best / ".hydra" / "config.yaml").read_text())
    assert float(rows[0]["val/acc"]) == pytest.approx(summary["metrics"]["val/acc"], rel=1e-5)
    assert float(rows[0]["optim.lr"]) == config["optim"]["lr"]

    import optuna

    study = optuna.load_study(study_name="trainkit",
                              storage=f"sqlite:///{sweep_dir / 'optuna.db'}")
    assert Path(study.best_trial.user_attrs["run_dir"]).name == best.name
    assert study.best_trial.params["optim.lr"] == config["optim"]["lr"]
    assert study.best_value == summary["metrics"]["val/acc"]

    monkeypatch.chdir(tmp_path)  # the same command again, in this process: the study goes on
    assert sweep_main([*sweep[1:], *extra]) == 0
    again = capsys.readouterr().out
    assert not [line for line in again.splitlines() if line.startswith("trial ")], again
    assert f"best: trial {study.best_trial.number}," in again
    with pytest.raises(SystemExit) as stop:  # other overrides in the same dir
        sweep_main([*sweep[1:], *extra[:-len(FEW_STEPS)], "trainer.max_steps=4"])
    assert stop.value.code == 2
    assert "begun with other settings" in error_report(capsys.readouterr().err)[1]


@needs_optuna
@pytest.mark.slow
def test_a_preempted_trial_gives_optuna_no_value_and_the_next_sweep_resumes_it(
        tmp_path: Path, mnist_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    once = tmp_path / "signalled"  # the first trial's model sends itself SIGTERM, once
    args = ["sweep", "--trials", "1", "--dir", "s", "+exp=mnist", "+sweep=lr",
            f"data.root={mnist_root}", *FEW_STEPS,
            "model._target_=tests.integration.signal_nets.EvalSignalNet", "~model.widths",
            f"+model.once={once}"]
    done = trainkit(*args, cwd=tmp_path)
    assert done.returncode == 75, done.stderr[-3000:]  # no new trial after a preemption
    assert "trial 0: " in done.stdout and "preempted" in done.stdout, done.stdout

    import optuna
    from optuna.trial import TrialState

    from trainkit.entry.sweep import open_study, read_plan

    storage = f"sqlite:///{tmp_path / 's' / 'optuna.db'}"
    [first] = optuna.load_study(study_name="trainkit", storage=storage).trials
    assert first.state == TrialState.FAIL and first.value is None  # nothing to learn from
    assert json.loads((tmp_path / "s" / "trial_000" / "summary.json").read_text())[
        "status"] == "preempted"
    # What the same command does first: queue the preempted trial again, in its own run dir.
    monkeypatch.chdir(tmp_path)
    plan = read_plan(args[5:])
    open_study(Path("s"), plan, None)
    study = open_study(Path("s"), plan, None)  # queued once only
    assert len(study.get_trials(states=(TrialState.WAITING,))) == 1
    again = study.ask(plan.space)  # what the sweep's next trial is
    assert again.params == first.params
    assert again.user_attrs["run_dir"] == first.user_attrs["run_dir"]


@needs_optuna
@pytest.mark.parametrize(("extra", "says"), [
    (["checkpoint.monitor=val/f1"], "checkpoint.monitor='val/f1' is not a metric the run "
                                    "reports: use one of val/loss, val/acc"),
    (["sweep.params={optim.lr:{low:1,high:0.1}}"], "sweep.params.optim.lr: `low <= high`"),
    (["~sweep"], "no search space"),
])
def test_bad_sweep_input_is_one_line_and_trains_nothing(
        tmp_path: Path, extra: list[str], says: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from trainkit.entry.sweep import main as sweep_main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        sweep_main(["--dir", "s", "+exp=mnist", "+sweep=lr", *extra])
    assert stop.value.code == 2
    assert says in error_report(capsys.readouterr().err)[1]
    assert not (tmp_path / "s").exists()


def write_run(path: Path, overrides: list[str], summary: dict | None, monitor: str | None) -> None:
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (path / ".hydra" / "config.yaml").write_text(yaml.safe_dump(
        {"checkpoint": {"monitor": monitor, "mode": "min"}}))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))


def test_runs_table_shows_what_differs_best_first_and_unfinished_runs_last(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trainkit.entry.runs import main as runs_main

    base = ["+exp=mnist", "data.batch_size=64", "hydra.run.dir=x"]
    write_run(tmp_path / "a", [*base, "optim.lr=0.1"],
              {"status": "completed", "global_step": 9, "metrics": {"val/loss": 0.5}}, "val/loss")
    write_run(tmp_path / "b", [*base, "optim.lr=0.01"],
              {"status": "completed", "global_step": 9, "metrics": {"val/loss": 0.25}},
              "val/loss")
    write_run(tmp_path / "c" / "d", [*base, "optim.lr=0.001"], None, "val/loss")
    assert runs_main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["run", "optim.lr", "status", "step", "val/loss"]
    assert [line.split()[:3] for line in lines[1:]] == [
        ["b", "0.01", "completed"], ["a", "0.1", "completed"], ["c/d", "0.001", "running?"]]

    (tmp_path / "empty").mkdir()
    for bad, says in [(tmp_path / "none", "is not a folder"),
                      (tmp_path / "empty", "no run dirs under")]:
        assert runs_main([str(bad)]) == 2
        assert says in error_report(capsys.readouterr().err)[1]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.skipif(not installed("hydra_plugins.hydra_submitit_launcher"),
                    reason="hydra-submitit-launcher not installed: pip install 'trainkit[slurm]'")
def test_submitit_local_launcher_runs_a_job_of_two_tasks_as_one_ddp_run(
        tmp_path: Path, mnist_root: Path) -> None:
    done = trainkit("train", "-m", "hydra/launcher=submitit_local",
                    "hydra.launcher.tasks_per_node=2", "hydra.sweep.dir=multi", "+exp=mnist",
                    f"data.root={mnist_root}", *FEW_STEPS, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "multi" / "0" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2
    shown = trainkit("runs", "multi", cwd=tmp_path)
    assert shown.stdout.splitlines()[1].split()[:3] == ["0", "completed", "3"], shown.stdout


def test_each_trial_says_when_it_starts_and_ends_with_its_parameters(
        tmp_path: Path, mnist_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 61, fault 13: a line as each trial starts (not only once it has trained), and one
    as it ends; here one trial of bad input, which also stops the sweep."""
    from trainkit.entry.sweep import Sweep, open_study, read_plan

    plan = read_plan(["+exp=mnist", "+sweep=lr", f"data.root={mnist_root}", *FEW_STEPS,
                      "trainer.max_epochs=-3"])
    sweep = Sweep(open_study(tmp_path / "s", plan, seed=0), plan, tmp_path / "s", trials=2)
    assert sweep.run(jobs=1) == 2
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2, lines
    started = re.fullmatch(r"trial 0 started: optim\.lr=(\S+)  \((.+)\)", lines[0])
    assert started and started[2] == str(tmp_path / "s" / "trial_000"), lines[0]
    assert re.fullmatch(rf"trial 0: optim\.lr={re.escape(started[1])} after \d+ s -> failed "
                        r"\(exit 2\): trainer\.max_epochs must be >= 1, got -3  \(.+\)",
                        lines[1]), lines[1]
