"""`python -m trainkit.verify_resume` on a user's config, and its mismatch report."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, error_report, run_module
from trainkit.checkpoint.files import save_atomic
from trainkit.entry.verify_resume import _report, main

CASES = {
    # shuffled in-memory batches, accumulation windows of 3, checkpoints written in the background
    "mnist": ("+exp=mnist", "trainer.accumulate_grad_batches=3", "checkpoint.async_save=true"),
    # the standard path: two workers transforming (crop, flip) one image at a time
    "mnist-dataloader": ("+exp=mnist", "data.loader=dataloader", "data.num_workers=2",
                         "data.random_crop_padding=2", "data.random_flip=true"),
    # batch augmentation on the device, label smoothing, SGD with Nesterov, one-cycle
    "cifar": ("+exp=cifar", "model.widths=[8,16,32,32]"),  # its recipe, a narrower net
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_resuming_is_bit_exact(tmp_path: Path, mnist_root: Path, cifar_root: Path,
                               case: str) -> None:
    root = cifar_root if case == "cifar" else mnist_root
    result = run_module(
        "trainkit.verify_resume", "--steps", "8", "--stop-at", "3", "--keep", str(tmp_path),
        "trainer.precision=32", *CASES[case], f"data.root={root}", "data.verify=false",
        "data.download=false", "data.batch_size=32")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "OK" in result.stdout and "stopped at step 3" in result.stdout
    (work,) = tmp_path.iterdir()
    state = torch.load(work / "resumed" / "checkpoints" / "last.pt", weights_only=True)
    assert state["global_step"] == 8


@pytest.mark.parametrize("keep", ["missing/folder", "a_file"])
def test_keep_that_is_no_folder_is_one_line(tmp_path: Path, mnist_root: Path, keep: str) -> None:
    (tmp_path / "a_file").write_text("not a folder")
    result = run_module("trainkit.verify_resume", "--keep", str(tmp_path / keep), "--steps", "4",
                        "+exp=mnist", f"data.root={mnist_root}", "data.verify=false",
                        "data.download=false", timeout=120)
    assert result.returncode == 2, result.stderr
    _, last = error_report(result.stderr)
    assert last.startswith("trainkit: --keep ") and "mkdir -p" in last
    assert f"--keep {tmp_path / keep}: " in result.stderr  # whole on a detail line when long
    assert (tmp_path / "a_file").read_text() == "not a folder"  # nothing deleted or replaced
    assert not (tmp_path / "missing").exists()


def _state(step: int, weight: float, rng: int, host: str = "a") -> dict:
    return {"model": {"w": torch.full((2,), weight)}, "optimizer": {"state": {}},
            "global_step": step, "rng": {"torch": torch.tensor([rng])},
            "manifest": {"host": host}}


def _write(root: Path, stop: dict, end: dict) -> Path:
    save_atomic(stop, root / "step_000000003.pt")
    save_atomic(end, root / "last.pt")
    return root


def test_report_tells_a_lost_state_from_a_nondeterministic_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    straight = _write(tmp_path / "a", _state(3, 1.0, 7), _state(10, 2.0, 9))
    same = _write(tmp_path / "b", _state(3, 1.0, 7, "b"), _state(10, 2.0, 9, "b"))
    assert _report(straight, same, 3, 10) == 0
    assert "OK" in capsys.readouterr().out  # the manifest differs, but names no state

    lost = _write(tmp_path / "c", _state(3, 1.0, 7), _state(10, 2.5, 8))
    assert _report(straight, lost, 3, 10) == 1
    out = capsys.readouterr().out
    assert "model.w: max abs difference 0.5" in out and "rng.torch" in out
    assert "identical" in out  # at the stop: so the resume lost something

    noisy = _write(tmp_path / "d", _state(3, 1.25, 7), _state(10, 2.5, 9))
    assert _report(straight, noisy, 3, 10) == 1
    assert "not deterministic" in capsys.readouterr().out


# -- --cmd: any script ------------------------------------------------------------------------

def verify_script(tmp_path: Path, *script_args: str) -> subprocess.CompletedProcess[str]:
    """``trainkit verify-resume --cmd`` on tests/helpers/phases.py (two fits of 8 steps, a
    checkpoint every 4), its stopped run waiting after step 6 for the SIGTERM sent once
    ``a/checkpoints/step_4`` exists (tests/helpers/verify_pause.py)."""
    script = REPO / "tests" / "helpers" / "phases.py"
    command = (f"{sys.executable} -m tests.helpers.verify_pause {{run_dir}}/paused 6 {script} "
               f"--run-dir {{run_dir}} {' '.join(script_args)}")
    return run_module("trainkit.entry.cli", "verify-resume", "--cmd", command,
                      "--keep", str(tmp_path))


@pytest.mark.slow
def test_a_script_of_two_phases_stopped_and_re_run_ends_bitwise_the_same(tmp_path: Path) -> None:
    result = verify_script(tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (line,) = result.stdout.strip().splitlines()
    # the first checkpoint file that appeared: step_N.pt or its last.pt, whichever was first
    assert re.match(r"verify-resume: OK -- stopped by SIGTERM after a/checkpoints/"
                    r"(step_\d+|last)\.pt and re-run", line), line
    assert "a/checkpoints/last.pt, b/checkpoints/last.pt" in line
    (work,) = tmp_path.iterdir()
    stopped = (work / "stopped.log").read_text()
    assert "stopped at step " in stopped and "phase a done" not in stopped  # mid-way through a
    assert torch.load(work / "stopped" / "b" / "checkpoints" / "last.pt",
                      weights_only=True)["global_step"] == 8


@pytest.mark.slow
def test_a_script_drawing_from_an_unseeded_generator_fails_naming_the_tensor(
        tmp_path: Path) -> None:
    result = verify_script(tmp_path, "--unseeded")
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    (line,) = result.stdout.strip().splitlines()
    assert line.startswith("verify-resume: MISMATCH -- ")
    assert "a/checkpoints/last.pt: model.0.weight differs (max abs difference " in line


def test_a_command_without_its_run_dir_or_with_overrides_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for args, words in ((["--cmd", "python x.py"], "--cmd must contain {run_dir}"),
                        (["--cmd", "python x.py {run_dir}", "--steps", "4"],
                         "--cmd runs your script as it is: --steps")):
        with pytest.raises(SystemExit) as status:
            main([*args, "--keep", str(tmp_path)])
        assert status.value.code == 2
        assert error_report(capsys.readouterr().err)[1].startswith(f"trainkit: {words}")
    assert not list(tmp_path.iterdir())  # refused before any folder was made
