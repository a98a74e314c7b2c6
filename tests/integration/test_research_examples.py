"""The four programs of examples/research/ (docs/research.md, "Your own step"), each run by
``trainkit verify-resume --cmd``: to its end; again, stopped by SIGTERM mid-run (exit 75) and
re-run: every final checkpoint bitwise equal. Each reaches its stated quality in the run to the
end. The stopped run waits at a known optimizer step for the signal (tests/helpers/
verify_pause.py), which verify-resume sends once that pause's marker exists."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_module

pytestmark = pytest.mark.slow
EXAMPLES = REPO / "examples" / "research"
# example: (its arguments, the optimizer step the stopped run pauses after: past a checkpoint)
RUNS = {
    "distill": ((), 96 + 40),  # the student's step 40 (the teacher took 96)
    "simclr": ((), 40),  # pre-training's step 40 of 96
    "gan": (("--steps", "1000"), 2 * 400),  # step 400 of 1000: two optimizers a step
    "multitask": ((), 40),
}


def verify(name: str, folder: Path) -> tuple[str, Path]:
    """verify-resume's line and its work folder, for example ``name``."""
    args, pause = RUNS[name]
    command = (f"{sys.executable} -m tests.helpers.verify_pause {{run_dir}}/paused {pause} "
               f"{EXAMPLES / name}.py --run-dir {{run_dir}} {' '.join(args)}")
    done = run_module("trainkit.entry.cli", "verify-resume", "--cmd", command,
                      "--signal-after", "paused", "--keep", str(folder), timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (work,) = folder.iterdir()
    stopped = (work / "stopped.log").read_text()
    assert "; re-run the same command to resume" in stopped  # stopped by the SIGTERM, saved
    return done.stdout.strip(), work


def metrics(run_dir: Path) -> dict[str, float]:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    return summary["metrics"]


def test_distillation_resumes_bitwise_and_the_student_nears_its_teacher(tmp_path: Path) -> None:
    line, work = verify("distill", tmp_path)
    assert line.startswith("verify-resume: OK") and "student/checkpoints/last.pt" in line
    teacher = metrics(work / "straight" / "teacher")["val/acc"]
    student = metrics(work / "straight" / "student")["val/acc"]
    assert teacher >= 0.85 and student >= teacher - 0.05, (teacher, student)


def test_simclr_and_its_probe_resume_bitwise_and_the_probe_learns(tmp_path: Path) -> None:
    line, work = verify("simclr", tmp_path)
    assert line.startswith("verify-resume: OK") and "probe/checkpoints/last.pt" in line
    assert metrics(work / "straight" / "probe")["val/acc"] >= 0.65  # a random encoder's: 0.43


def test_the_gan_resumes_bitwise_and_covers_all_eight_modes(tmp_path: Path) -> None:
    line, work = verify("gan", tmp_path)
    assert line.startswith("verify-resume: OK")
    found = metrics(work / "straight")
    assert found["val/modes"] == 8 and found["val/good"] >= 0.5, found


def test_the_multi_task_net_resumes_bitwise_and_both_heads_learn(tmp_path: Path) -> None:
    line, work = verify("multitask", tmp_path)
    assert line.startswith("verify-resume: OK")
    found = metrics(work / "straight")
    assert found["val/digit_acc"] >= 0.85 and found["val/shift_acc"] >= 0.8, found
