"""The byte-level LM example (examples/char_lm.py) run for real: preempted between two
evaluations and re-run, its weights, evaluations, samples and early stop match an uninterrupted
run's; its bad input is one line and exit 2, its checkpoints kept."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, assert_same_weights, error_report, last_checkpoint, offline_env
from trainkit.core.errors import LINE_LIMIT

# 16 steps, an evaluation every 4 on 2 batches; min_delta so large that only the first evaluation
# improves: patience 2 stops the run at step 12 -- unless the count were lost in a resume.
ARGS = ["--max-bytes", "60000", "--steps", "16", "--batch-size", "8", "--block", "32",
        "--dim", "32", "--layers", "2", "--eval-every", "4", "--eval-batches", "2",
        "--log-every", "2", "--checkpoint-every", "100", "--patience", "2", "--min-delta", "100",
        "--precision", "bf16-mixed", "--ema", "0.9", "--workers", "2", "--device", "cpu"]


def lm_command(run_dir: Path, *callbacks: str, forward: str | None = None) -> list[str]:
    """The example's main() with test callbacks added (or its forward replaced)."""
    code = ["import sys; sys.path.insert(0, 'examples')",
            "import char_lm, tests.helpers.callbacks as t"]
    if forward:
        code.append(f"char_lm.forward = {forward}")
    code.append(f"char_lm.main(sys.argv[1:], callbacks=[{', '.join(callbacks)}])")
    return [sys.executable, "-c", "; ".join(code), "--run-dir", str(run_dir), *ARGS]


def start(command: list[str]) -> subprocess.Popen[str]:
    # one thread each: 2 cores shared with the DataLoader workers (and other tests)
    return subprocess.Popen(command, cwd=REPO, env=offline_env(OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str], status: int) -> str:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == status, (proc.returncode, out[-2000:], err[-2000:])
    return out


def evaluations(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["val/loss"] for line in lines if "val/loss" in line}


def samples(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("sample at step")]


@pytest.fixture(scope="module")
def preempted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A run stopped by SIGTERM at step 10, between the evaluations of steps 8 and 12, after the
    first one without improvement; and its stdout. Shared: the tests re-run copies of it."""
    cut = tmp_path_factory.mktemp("char_lm") / "cut"
    out_cut = finish(start(lm_command(cut, "t.SigtermAt(10)")), 75)
    assert last_checkpoint(cut)["global_step"] == 10
    return cut, out_cut


def test_preempted_between_evaluations_then_rerun_matches_an_uninterrupted_run(
        tmp_path: Path, preempted: tuple[Path, str]) -> None:
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    shutil.copytree(preempted[0], cut)
    out_whole, out_cut = finish(start(lm_command(whole)), 0), preempted[1]
    out_resumed = finish(start(lm_command(cut)), 0)

    for run_dir in (whole, cut):  # early stopping counted across the resume: both stop at 12
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "stopped" and summary["global_step"] == 12, summary
        assert "early stopping: val/loss did not improve" in summary["stop_reason"]
        assert summary["stop_reason"] in (run_dir / "train.log").read_text()
    a, b = last_checkpoint(whole), last_checkpoint(cut)
    assert_same_weights(a["model"], b["model"])
    assert_same_weights(a["ema"]["weights"], b["ema"]["weights"])
    assert a["callbacks"]["EarlyStopping"] == b["callbacks"]["EarlyStopping"] == {
        "best": a["callbacks"]["EarlyStopping"]["best"], "bad_evaluations": 2}
    # the same evaluation steps with the same results, and the same samples printed
    assert evaluations(whole) == evaluations(cut) and list(evaluations(whole)) == [4, 8, 12]
    assert samples(out_whole) == samples(out_cut) + samples(out_resumed)
    assert len(samples(out_whole)) == 3
    assert "train/z_loss" in (whole / "metrics.jsonl").read_text()


def test_bad_input_is_one_line_exit_2_and_keeps_the_checkpoint(
        tmp_path: Path, preempted: tuple[Path, str]) -> None:
    """A preempted run, then re-runs that fail: a forward whose third item is no mapping, one
    whose scalar is a vector. The checkpoint stays as it was."""
    run_dir = tmp_path / "run"
    shutil.copytree(preempted[0], run_dir)
    before = (run_dir / "checkpoints" / "last.pt").read_bytes()
    bad = {
        "lambda m, b: (*char_lm.forward(m, b)[:2], [1.0])":
            "forward's third item is a list, not a mapping",
        "lambda m, b: (*char_lm.forward(m, b)[:2], {'aux': b['tokens'][0].float()})":
            "forward's scalar 'aux' has shape (33,)",
    }
    procs = [start(lm_command(run_dir, forward=f"(lambda f: {code})(char_lm.forward)"
                              .replace("char_lm.forward(m, b)", "f(m, b)")))
             for code in bad]
    for proc, words in zip(procs, bad.values()):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (out[-2000:], err[-2000:])
        _, last = error_report(err)
        assert words in last and len(last) <= LINE_LIMIT, last
    assert (run_dir / "checkpoints" / "last.pt").read_bytes() == before
