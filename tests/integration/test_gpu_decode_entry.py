"""``python -m trainkit.train data=image_folder data.decode=gpu``: refused in one line without
CUDA (exit 2, no run folder); on CUDA, a few steps train and resume as with ``decode=cpu``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import error_report, run_train
from tests.image_files import make_folder
from tests.integration.test_image_folder import folder_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_folder(tmp_path_factory.mktemp("images"), per_class=4, val_per_class=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_decode_gpu_without_cuda_is_one_line_and_writes_nothing(tmp_path: Path,
                                                                folder: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_train(*folder_run(run_dir, folder, "data.decode=gpu"))
    assert result.returncode == 2, result.stderr[-2000:]
    _, last = error_report(result.stderr)
    assert "data.decode=gpu needs a CUDA device" in last and last.endswith(
        "use data.decode=cpu"), last
    assert not run_dir.exists() or not any(run_dir.iterdir())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_gpu_trains_a_few_steps_on_cuda(tmp_path: Path, folder: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_train(*folder_run(run_dir, folder, "data.decode=gpu", "trainer.device=cuda",
                                   "trainer.max_epochs=1"))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] > 0, summary
