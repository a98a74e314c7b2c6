"""``trainkit.preemptible()`` around a script of two phases (tests/helpers/phases.py): a real
signal during a fit's set-up, between the phases, or in a step; exit 75 and a re-run that skips
the finished phase and resumes the other."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import (
    assert_same_weights,
    last_checkpoint,
    start_module,
)

MESSAGE = ("trainkit: stopped by {} outside the training steps (before the first or after the "
           "last); re-run the same command to start or resume the run")


def script(run_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """The script run to its end in a process of its own, hearing the signals it sends itself."""
    proc = start_module("tests.helpers.phases", "--run-dir", str(run_dir), *extra)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("straight")
    done = script(run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "phase b completed" in done.stdout
    return run_dir


def test_a_sigterm_in_a_fits_set_up_is_one_line_and_status_75(tmp_path: Path) -> None:
    done = script(tmp_path, "--signal-at", "setup")
    assert done.returncode == 75, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == MESSAGE.format("SIGTERM")
    assert "phase a done" not in done.stdout
    assert not list(tmp_path.glob("a/checkpoints/*.pt"))


def test_a_signal_between_phases_stops_and_the_re_run_skips_the_finished_one(
        tmp_path: Path, straight: Path) -> None:
    done = script(tmp_path, "--signal-at", "between")
    assert done.returncode == 75, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == MESSAGE.format("SIGINT")
    assert "phase a done" in done.stdout and "phase b" not in done.stdout
    assert not (tmp_path / "b").exists()
    first = (tmp_path / "a" / "checkpoints" / "last.pt").read_bytes()

    again = script(tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "phase b completed" in again.stdout
    assert (tmp_path / "a" / "checkpoints" / "last.pt").read_bytes() == first  # not trained again
    assert_same_weights(last_checkpoint(tmp_path / "b")["model"],
                        last_checkpoint(straight / "b")["model"])


def test_a_sigterm_in_a_step_saves_exits_75_and_the_re_run_resumes_bit_exactly(
        tmp_path: Path, straight: Path) -> None:
    done = script(tmp_path, "--signal-at", "step")
    assert done.returncode == 75, done.stderr[-3000:]
    assert "phase b" not in done.stdout  # the fit's stop ends the script: nothing after it
    assert last_checkpoint(tmp_path / "b")["global_step"] == 3

    again = script(tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "phase b completed" in again.stdout
    assert_same_weights(last_checkpoint(tmp_path / "b")["model"],
                        last_checkpoint(straight / "b")["model"])
