"""`python -m trainkit.verify_resume` on a user's config, and its mismatch report."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import error_report, run_module
from trainkit.checkpoint.files import save_atomic
from trainkit.entry.verify_resume import _report

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
