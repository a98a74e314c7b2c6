"""A new kind of data in three files (``trainkit/data/sources/npy_folder.py``, its row in
``SOURCES``, ``configs/data/npy_folder.yaml``) runs through every command: train, evaluate,
predict, export, estimate and probe, each asking its Source, none switching on its name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_train
from trainkit.data import source_of
from trainkit.entry import cli, estimate, probe

pytestmark = pytest.mark.slow

CLASSES, SHAPE = 3, (3, 12, 12)


def _arrays(root: Path, split: str, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % CLASSES
    images = rng.integers(0, 256, (n, *SHAPE), dtype=np.uint8)
    images[:, labels % 3] //= 2  # something to learn: a darker channel per class
    np.save(root / f"{split}_images.npy", images)
    np.save(root / f"{split}_labels.npy", labels)


@pytest.fixture(scope="module")
def arrays(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("arrays")
    _arrays(root, "train", 24, 0)
    _arrays(root, "val", 12, 1)
    return root


def overrides(root: Path) -> list[str]:
    return ["data=npy_folder", f"data.root={root}", "data.batch_size=8",
            "data.eval_batch_size=6", "model._target_=tests.image_files.TinyNet",
            "~model.widths", "trainer.precision=32", "trainer.max_epochs=2",
            "trainer.log_every_n_steps=1", "sched=constant"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, arrays: Path) -> Path:
    """One trained run, shared by every command below."""
    run_dir = tmp_path_factory.mktemp("npy_run")
    result = run_train(*overrides(arrays), f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-2000:]
    return run_dir


def test_the_source_answers_from_its_arrays(arrays: Path) -> None:
    source = source_of("npy_folder")
    data = type("Data", (), {"root": str(arrays)})()
    assert source.known_classes(arrays) == CLASSES
    assert source.shape(data) == SHAPE
    images, labels = source.example_batch(data, 5, device="cpu")()
    assert images.shape == (5, *SHAPE) and labels.shape == (5,)
    split = source.read_split(data, train=False)
    assert len(split) == 12 and split.num_classes == CLASSES


def test_train_then_evaluate_reproduces_the_recorded_metrics(run: Path) -> None:
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 6
    assert cli.main(["evaluate", str(run), "ckpt=last"]) == 0
    again = json.loads((run / "eval_last.json").read_text())
    assert again["metrics"]["val/loss"] == pytest.approx(summary["metrics"]["val/loss"],
                                                         rel=1e-5)


def test_predict_and_export_take_the_arrays_split_and_inputs(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    assert cli.main(["predict", str(run), "inputs=test", f"out={out}"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 12
    export = tmp_path / "export"
    assert cli.main(["export", str(run), "--out", str(export)]) == 0
    info = json.loads((export / "model.json").read_text())
    assert info["image_size"] == list(SHAPE) and info["num_classes"] == CLASSES


def test_estimate_and_probe_make_batches_of_the_arrays_shape(
        arrays: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "estimate.json"
    assert estimate.main(["--device", "cpu", "--json", str(report), *overrides(arrays)]) == 0
    assert json.loads(report.read_text())["fits"] is True
    figures = tmp_path / "probe.json"
    assert probe.main(["--seconds", "0.3", "--out", str(figures), *overrides(arrays)]) == 0
    measured = json.loads(figures.read_text())
    assert measured["batch_size"] == 8 and measured["verdict"]["bound"] in ("input", "compute")
    # the in-memory form is the Source's answer (in_memory): no variant retries it
    assert all(v["setting"] != "data.loader=memory" for v in measured["variants"])
