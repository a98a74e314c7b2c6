"""Issue 51 through the real entry point: a resnet18 trained by trainkit on one image folder,
exported to safetensors, fine-tuned with ``+exp=finetune_image model.pretrained=`` on another
folder with another class count: the head is replaced, the first epoch trains the head alone,
and the fine-tuned run beats the same run from random weights."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torchvision.models import resnet18

from tests.conftest import error_report, run_module, run_train
from tests.image_files import make_digits
from trainkit.checkpoint.select import available

pytestmark = pytest.mark.slow

SMALL = ("data.image_size=32", "data.scale=[0.7,1.0]", "data.random_flip=false",
         "data.num_workers=0", "trainer.precision=32", "trainer.log_every_n_steps=1")


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """resnet18 trained on upright digits 0-9 (70 steps, ~0.95 validation accuracy), exported
    as safetensors with `trainkit export`."""
    tmp = tmp_path_factory.mktemp("pretrain")
    digits = make_digits(tmp / "digits", range(10), per_class=30, val_per_class=10)
    run = tmp / "run"
    result = run_train("data=image_folder", "model=resnet18", "sched=constant", *SMALL,
                       f"data.root={digits}", f"hydra.run.dir={run}", "data.batch_size=32",
                       "trainer.max_epochs=7", "optim.lr=1e-3")
    assert result.returncode == 0, result.stderr[-2000:]
    out = tmp / "export"
    export = run_module("trainkit.entry.cli", "export", str(run), "--format", "safetensors",
                        "--out", str(out))
    assert export.returncode == 0, export.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def rotated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Five of the digits turned 90 degrees, 6 training images of each: another task, another
    class count, and too few images to learn it from random weights in 9 steps."""
    return make_digits(tmp_path_factory.mktemp("rotated"), [2, 3, 4, 5, 7], per_class=6,
                       val_per_class=20, rotate=90, seed=1)


def finetune(run_dir: Path, root: Path, pretrained: Path | str) -> subprocess.CompletedProcess:
    return run_train("+exp=finetune_image", *SMALL, f"model.pretrained={pretrained}",
                     f"data.root={root}", f"hydra.run.dir={run_dir}", "data.batch_size=10",
                     "trainer.max_epochs=3", "trainer.channels_last=false",
                     "sched.warmup_steps=0", "checkpoint.every_n_steps=3")


def test_the_finetuned_resnet18_replaces_its_head_trains_it_alone_first_and_beats_random(
        tmp_path: Path, exported: Path, rotated: Path) -> None:
    tuned = finetune(tmp_path / "tuned", rotated, exported)
    assert tuned.returncode == 0, tuned.stderr[-2000:]
    log = (tmp_path / "tuned" / "train.log").read_text()
    lines = log.splitlines()
    assert sum("re-initialised" in line for line in lines) == 1
    assert "fc.weight [10, 512] -> [5, 512], fc.bias [10] -> [5]" in log
    assert "model.pretrained: 120 of 122 weights loaded" in log
    first = next(line for line in lines if "training ResNet" in line)
    assert "11.2M parameters: 2.6K train, 11.2M frozen" in first  # fc: 512 x 5 + 5
    assert "epoch 2: 60 parameter tensors (11.2M) unfrozen" in log

    pretrained = load_file(exported / "model.safetensors")
    backbone = {name for name, _ in resnet18().named_parameters()} - {"fc.weight", "fc.bias"}
    saved = available(tmp_path / "tuned" / "checkpoints")
    after_head_epoch = torch.load(saved["step_3"], weights_only=True)["model"]
    end = torch.load(saved["last"], weights_only=True)["model"]
    for name in backbone:  # epoch 1: the backbone as pretrained; then it trains too
        assert torch.equal(after_head_epoch[name], pretrained[name]), name
    assert not torch.equal(after_head_epoch["fc.weight"], end["fc.weight"])
    assert not all(torch.equal(end[name], pretrained[name]) for name in backbone)

    scratch = finetune(tmp_path / "scratch", rotated, "null")
    assert scratch.returncode == 0, scratch.stderr[-2000:]
    acc = {run: json.loads((tmp_path / run / "summary.json").read_text())["metrics"]["val/acc"]
           for run in ("tuned", "scratch")}
    assert acc["tuned"] >= acc["scratch"] + 0.1, acc  # seeded: the same numbers every run


def test_a_file_that_is_not_weights_stops_the_run_in_one_line_before_anything_is_written(
        tmp_path: Path, rotated: Path) -> None:
    junk = tmp_path / "weights.pth"
    junk.write_bytes(bytes(range(256)) * 8)
    result = finetune(tmp_path / "run", rotated, junk)
    assert result.returncode == 2
    details, last = error_report(result.stderr)  # a long path: the line whole as a detail
    assert f"model.pretrained={junk} is not a weights file" in details[-1]
    assert last.startswith("trainkit: model.pretrained=/") and last.endswith(
        "not a weights file that loads safely (Unsupported operand 0): give a state dict "
        "(.safetensors, .pt) or a model folder")
    assert not (tmp_path / "run").exists()
