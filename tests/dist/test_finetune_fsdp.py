"""Fine-tuning under real torchrun (2 processes, gloo, CPU) with ``trainer.strategy=fsdp``:
pretrained weights loaded before sharding, the head re-initialised, the backbone frozen; the
run completes and resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.dist.nets import FlatNet
from tests.dist.test_torchrun import data_root, overrides, torchrun  # noqa: F401 (a fixture)
from trainkit.checkpoint.select import read_whole

pytestmark = pytest.mark.dist


def test_a_frozen_pretrained_backbone_trains_its_new_head_under_fsdp_and_resumes(
        tmp_path: Path, data_root: Path) -> None:  # noqa: F811
    torch.manual_seed(1)
    pretrained = {k: v + 1.0 for k, v in FlatNet(num_classes=7).state_dict().items()}
    save_file(pretrained, tmp_path / "backbone.safetensors")
    run = tmp_path / "run"
    args = overrides(tmp_path, data_root, "trainer.strategy=fsdp", "trainer.freeze=[net.1.*]",
                     f"model.pretrained={tmp_path / 'backbone.safetensors'}", run_dir=run)
    first = torchrun(*args, "trainer.max_steps=4")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    log = (run / "train.log").read_text()
    assert "net.3.weight [7, 32] -> [10, 32], net.3.bias [7] -> [10]" in log
    assert "25.4K parameters: 330 train, 25.1K frozen" in log  # 32 x 10 + 10; 784 x 32 + 32
    assert (run / "checkpoints" / "last").is_dir()  # sharded: a directory

    again = torchrun(*args, "trainer.max_steps=6")  # resumes from step 4's directory
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 6
    assert summary["world_size"] == 2
    assert "resumed from" in (run / "train.log").read_text()
    weights = read_whole(run / "checkpoints" / "last")["model"]
    for name in ("net.1.weight", "net.1.bias"):  # frozen: as loaded
        assert torch.equal(weights[name], pretrained[name]), name
    assert not torch.equal(weights["net.3.bias"], torch.zeros(10))  # the new head trained
