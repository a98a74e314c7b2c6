"""`+exp=cifar` end to end on generated CIFAR-10-format files, and the data command."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import error_report, run_module, run_train

pytestmark = pytest.mark.slow


def _cifar_run(run_dir: Path, root: Path, *extra: str) -> list[str]:
    # tiny widths and fp32: a CPU smoke test of the real experiment config
    return ["+exp=cifar", f"hydra.run.dir={run_dir}", f"data.root={root}", "data.verify=false",
            "data.download=false", "trainer.precision=32", "model.widths=[8,16,32,32]",
            "data.batch_size=50", "data.eval_batch_size=100", "trainer.max_epochs=3",
            "trainer.log_every_n_steps=5", *extra]


def test_cifar_experiment_trains_on_cifar_format_files(tmp_path: Path, cifar_root: Path) -> None:
    result = run_train(*_cifar_run(tmp_path, cifar_root))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 30  # 500/50 x 3
    # the generated classes are easy: a working pipeline learns them in three short epochs
    assert summary["metrics"]["val/acc"] > 0.3
    assert summary["world_size"] == 1
    log = (tmp_path / "train.log").read_text()
    assert "training CifarNet" in log


def test_cifar_missing_files_name_the_data_command(tmp_path: Path) -> None:
    result = run_train("+exp=cifar", f"hydra.run.dir={tmp_path / 'run'}",
                       f"data.root={tmp_path / 'empty'}", "data.download=false")
    assert result.returncode == 2
    details, last = error_report(result.stderr)
    assert "python -m trainkit.data download cifar10 --root DIR" in last
    assert f"{tmp_path / 'empty' / 'cifar-10-batches-py'} lacks data_batch_1" in details[0]


def test_data_command_verify_reports_bad_and_missing(tmp_path: Path, cifar_root: Path) -> None:
    def data_cmd(*args: str) -> subprocess.CompletedProcess[str]:
        return run_module("trainkit.data", *args, timeout=120)

    bad = data_cmd("verify", "--root", str(cifar_root))
    assert bad.returncode == 2 and "not the official" in bad.stderr
    # the root has no MNIST folder: said, not passed over in silence
    assert f"mnist: skipped, no {cifar_root / 'MNIST' / 'raw'}" in bad.stdout, bad.stdout
    assert "cifar10: skipped" not in bad.stdout
    assert "RuntimeWarning" not in bad.stderr  # runpy: trainkit.data is a package
    missing = data_cmd("verify", "mnist", "--root", str(cifar_root))
    assert missing.returncode == 2 and "train-images-idx3-ubyte" in missing.stderr
    offline = data_cmd("download", "cifar10", "--root", str(tmp_path))
    assert offline.returncode == 2
    details, last = error_report(offline.stderr)
    assert "download failed" in last and any("Error" in line for line in details), details
