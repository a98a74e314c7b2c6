"""``+exp=folder`` with every image regulariser on (RandAugment, random erasing, MixUp and
CutMix, repeated augmentation, an EMA): it trains on real files with 2 loader workers,
evaluates with hard labels, and a run stopped mid-epoch resumes bitwise
(``trainkit.verify_resume``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import error_report, run_module, run_train_many
from tests.image_files import make_folder

pytestmark = pytest.mark.slow

REGULARISED = ("data.auto_augment=randaugment", "data.random_erasing=0.5", "data.mixup=0.8",
               "data.cutmix=1.0", "data.repeated_aug=3")


def folder_exp(root: Path, *extra: str) -> list[str]:
    """A few steps of ``+exp=folder`` (resnet18) on a generated folder, 2 loader workers."""
    return ["+exp=folder", f"data.root={root}", "data.image_size=24", "data.batch_size=4",
            "data.eval_batch_size=8", "data.num_workers=2", "trainer.precision=32",
            "trainer.channels_last=false", "trainer.log_every_n_steps=1", *extra]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 classes x 6 training files of mixed formats (5 batches of 4 an epoch), 2 to validate."""
    return make_folder(tmp_path_factory.mktemp("images"), per_class=6, val_per_class=2)


@pytest.fixture(scope="module")
def verified(tmp_path_factory: pytest.TempPathFactory, folder: Path) -> Path:
    """verify_resume's two runs (straight; stopped at step 3 of 6, mid-epoch, and resumed)."""
    keep = tmp_path_factory.mktemp("verify")
    result = run_module("trainkit.verify_resume", "--steps", "6", "--stop-at", "3",
                        "--keep", str(keep), *folder_exp(folder, *REGULARISED), timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "OK" in result.stdout and "stopped at step 3" in result.stdout
    (work,) = keep.iterdir()
    return work


def test_every_regulariser_on_resumes_bitwise(verified: Path) -> None:
    state = torch.load(verified / "resumed" / "checkpoints" / "last.pt", weights_only=True)
    assert state["global_step"] == 6
    assert state["ema"], "the EMA of +exp=folder is kept"


def test_mixed_training_evaluates_hard_labels(verified: Path) -> None:
    rows = [json.loads(line) for line in
            (verified / "resumed" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    accs = [r["val/acc"] for r in rows if "val/acc" in r]
    assert losses and all(v == v for v in losses)  # soft targets: a finite loss
    assert accs and all(0.0 <= a <= 1.0 for a in accs)
    state = torch.load(verified / "resumed" / "checkpoints" / "last.pt", weights_only=True)
    data = state["config"]["data"]
    assert (data["mixup"], data["cutmix"], data["auto_augment"]) == (0.8, 1.0, "randaugment")
    assert data["repeated_aug"] == 3


def test_bad_values_are_one_line(tmp_path: Path, folder: Path) -> None:
    """Through the entry point (the keys' other refusals: tests/unit/data/test_image_keys.py)."""
    runs = {"augment": folder_exp(folder, "data.auto_augment=autoaugment"),
            "drop_path": ["+exp=folder", f"data.root={folder}", "model.drop_path=0.1"]}
    results = run_train_many(runs, tmp_path / "runs")
    expected = {"augment": "data.auto_augment='autoaugment'",
                "drop_path": "model.drop_path: torchvision.models.resnet18 takes no "}
    for name, result in results.items():
        assert result.returncode == 2, (name, result.stderr[-2000:])
        _, last = error_report(result.stderr)
        assert expected[name] in last, (name, last)


def test_cifar_in_memory_batches_mix_and_resume_bitwise(tmp_path: Path, cifar_root: Path) -> None:
    """+exp=cifar's batches, gathered and augmented on the device, mixed there too."""
    result = run_module(
        "trainkit.verify_resume", "--steps", "8", "--stop-at", "3", "--keep", str(tmp_path),
        "+exp=cifar", "model.widths=[8,16,32,32]", f"data.root={cifar_root}",
        "data.verify=false", "data.download=false", "data.batch_size=32", "trainer.precision=32",
        "data.mixup=0.5", "data.cutmix=1.0", "data.repeated_aug=2")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "OK" in result.stdout and "stopped at step 3" in result.stdout
    (work,) = tmp_path.iterdir()
    rows = [json.loads(line) for line in (work / "resumed" / "metrics.jsonl").read_text()
            .splitlines()]
    assert any("val/acc" in r for r in rows)
