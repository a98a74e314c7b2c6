"""The entry point under SLURM, with SLURM's variables set as ``srun`` sets them: DDP without
torchrun, and a job warned by SIGUSR1 that saves, requeues itself (a fake ``scontrol`` first on
the PATH records how) and resumes in the same run dir.

The processes run in a temporary folder: under SLURM the default run dir is
``outputs/slurm-<job id>`` there.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.conftest import (
    REPO,
    assert_same_weights,
    error_report,
    hear_preemption_signals,
    last_checkpoint,
    offline_env,
    pause_at,
    wait_for_pause,
)

pytestmark = [pytest.mark.slow, pytest.mark.dist]

# 16 steps; a run stopped by SIGUSR1 waits for it at the end of step 2 (pause_at)
SLOW = ("trainer.max_epochs=2",)


def overrides(data_root: Path, *extra: str) -> list[str]:
    """A few-step MNIST-format run of a small net, into Hydra's default run dir."""
    return ["+exp=mnist", f"data.root={data_root}", "data.verify=false", "data.download=false",
            "data.batch_size=64", "data.eval_batch_size=128", "trainer.log_every_n_steps=1",
            "trainer.precision=32", "model._target_=tests.dist.nets.FlatNet", "~model.widths",
            *extra]


def slurm_env(job: str, *, rank: int = 0, ntasks: int = 1, **extra: str) -> dict[str, str]:
    """The variables ``srun`` gives one task of job ``job`` on this host."""
    env = offline_env(TRAINKIT_DIST_TIMEOUT_S="60", PYTHONPATH=str(REPO),
                      **{"SLURM_JOB_ID": job, "SLURM_PROCID": str(rank),
                         "SLURM_LOCALID": str(rank), "SLURM_NTASKS": str(ntasks),
                         "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": os.uname().nodename,
                         **extra})
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "TRAINKIT_RUN_NAME"):
        env.pop(name, None)
    return env


def start(cwd: Path, env: dict[str, str], *args: str,
          command: Sequence[str] = (sys.executable, "-m", "trainkit.train")) -> subprocess.Popen:
    with open(cwd / f"out_{env['SLURM_PROCID']}.txt", "ab") as out:  # the child has its copy
        return subprocess.Popen([*command, *args], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, preexec_fn=hear_preemption_signals)


def output(cwd: Path, rank: int = 0) -> str:
    return (cwd / f"out_{rank}.txt").read_text()


def test_two_srun_tasks_train_ddp_without_torchrun(tmp_path: Path, mnist_root: Path) -> None:
    job = str(random.Random().randrange(10**6))  # its port: no clash with a parallel test's
    procs = [start(tmp_path, slurm_env(job, rank=rank, ntasks=2),
                   *overrides(mnist_root, "trainer.max_steps=4"))
             for rank in (0, 1)]
    for rank, proc in enumerate(procs):
        assert proc.wait(timeout=240) == 0, output(tmp_path, rank)[-3000:]
    run_dir = tmp_path / "outputs" / f"slurm-{job}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert summary["global_step"] == 4
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == [f"slurm-{job}"]


@pytest.fixture
def fake_scontrol(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A PATH with an ``scontrol`` that appends its arguments to a file, and that file."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol_calls.txt"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\n')
    (bin_dir / "scontrol").chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}, calls


def stop_with_sigusr1(cwd: Path, env: dict[str, str], run_dir: Path, command: list[str]
                      ) -> int:
    """Start ``command`` (its overrides last) with its run waiting for a signal at the end of
    step 2, send SLURM's warning once it waits; return the stop's step."""
    marker = cwd / "paused"
    marker.unlink(missing_ok=True)  # an earlier stop's
    proc = start(cwd, env, command=[*command, *pause_at(2, marker)])
    wait_for_pause(proc, marker)
    proc.send_signal(signal.SIGUSR1)  # as SLURM sends it (to the batch script: B:USR1)
    assert proc.wait(timeout=120) == 75, output(cwd)[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "preempted"
    stopped_at = summary["global_step"]
    assert [p.name for p in (run_dir / "checkpoints").glob("step_*.pt")] == [
        f"step_{stopped_at:09d}.pt"]  # one checkpoint, the stop's
    return stopped_at


def test_sigusr1_saves_requeues_once_and_the_requeued_job_resumes_bit_exactly(
        tmp_path: Path, mnist_root: Path, fake_scontrol: tuple[dict[str, str], Path]) -> None:
    path, calls = fake_scontrol
    straight = tmp_path / "straight"
    done = subprocess.run([sys.executable, "-m", "trainkit.train",
                           *overrides(mnist_root, *SLOW, f"hydra.run.dir={straight}")],
                          cwd=tmp_path, env=offline_env(PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]

    env = slurm_env("8123", **path)
    run_dir = tmp_path / "outputs" / "slurm-8123"
    stopped_at = stop_with_sigusr1(tmp_path, env, run_dir, [
        sys.executable, "-m", "trainkit.train", *overrides(mnist_root, *SLOW)])
    assert calls.read_text() == "requeue 8123\n"  # once, with the job's id
    assert "requeued SLURM job 8123" in output(tmp_path)

    resumed = start(tmp_path, env, *overrides(mnist_root, *SLOW))  # SLURM starts it again
    assert resumed.wait(timeout=240) == 0, output(tmp_path)[-3000:]
    assert f"at step {stopped_at}" in output(tmp_path)
    assert calls.read_text() == "requeue 8123\n"  # a completed run requeues nothing
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["slurm-8123"]
    assert_same_weights(last_checkpoint(run_dir)["model"], last_checkpoint(straight)["model"])


def test_the_example_batch_script_passes_the_warning_on_and_an_array_task_requeues_by_its_id(
        tmp_path: Path, mnist_root: Path, fake_scontrol: tuple[dict[str, str], Path]) -> None:
    """examples/slurm/train.sbatch, run as SLURM runs it (its ``srun`` a stand-in that starts the
    one task), gets SLURM's ``B:USR1`` warning itself: its trap passes it on to the task."""
    path, calls = fake_scontrol
    fake_srun = Path(path["PATH"].split(os.pathsep)[0]) / "srun"
    fake_srun.write_text('#!/bin/sh\nexec "$@"\n')  # one task: the command itself
    fake_srun.chmod(0o755)
    env = slurm_env("9007", SLURM_ARRAY_JOB_ID="9000", SLURM_ARRAY_TASK_ID="7",
                    SLURM_SUBMIT_DIR=str(tmp_path),
                    PATH=f"{fake_srun.parent}{os.pathsep}{Path(sys.executable).parent}"
                         f"{os.pathsep}{path['PATH']}")  # its `python`: this one
    run_dir = tmp_path / "outputs" / "slurm-9000_7"
    script = ["bash", str(REPO / "examples" / "slurm" / "train.sbatch"),
              *overrides(mnist_root, *SLOW)]
    stop_with_sigusr1(tmp_path, env, run_dir, script)
    assert calls.read_text() == "requeue 9000_7\n"

    calls.unlink()  # a container without scontrol: one line, and 75 as before
    env = slurm_env("9008", PATH=os.path.dirname(sys.executable) + os.pathsep + "/usr/bin")
    stop_with_sigusr1(tmp_path, env, tmp_path / "outputs" / "slurm-9008",
                      [sys.executable, "-m", "trainkit.train", *overrides(mnist_root, *SLOW)])
    assert not calls.exists()
    said = [line for line in output(tmp_path).splitlines() if "not requeued" in line]
    assert len(said) == 1 and "scontrol is not on the PATH" in said[0], said


def test_a_malformed_array_id_is_one_line_before_any_folder_is_made(tmp_path: Path) -> None:
    """(A node list that does not parse takes the same path: tests/unit/distributed.)"""
    env = slurm_env("9100", SLURM_ARRAY_JOB_ID="9000", SLURM_ARRAY_TASK_ID="seven")
    says = "SLURM_ARRAY_TASK_ID='seven' is not a number"
    done = subprocess.run([sys.executable, "-m", "trainkit.train", "+exp=mnist"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert says in error_report(done.stderr)[1]
    assert list(tmp_path.iterdir()) == []
