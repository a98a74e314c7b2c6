"""trainkit used as a library, without Hydra: the example script and a custom batch format."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import REPO, start_in_own_group, wait_for_pause
from trainkit import CheckpointConfig, Trainer, TrainerConfig, seed_everything


@pytest.mark.slow
def test_example_script_trains_and_resumes(tmp_path: Path) -> None:
    cmd = [sys.executable, "examples/library_api.py", "--run-dir", str(tmp_path), "--epochs", "2"]
    first = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["global_step"] == 64 and summary["metrics"]["val/mae"] < 0.5
    assert (tmp_path / "checkpoints" / "step_000000064.pt").is_file()
    # a second run of the same command finds the finished run and does not train again
    cmd[-1] = "3"
    second = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from" in second.stdout
    assert json.loads((tmp_path / "summary.json").read_text())["global_step"] == 96


@pytest.mark.slow
def test_example_stopped_in_its_first_epoch_exits_75_and_resumes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "examples/library_api.py", "--run-dir", str(run_dir), "--epochs", "1"]
    # the example as it is, waiting for the signal after its 16th optimizer step of 32
    marker = tmp_path / "paused"
    proc = start_in_own_group([sys.executable, "-m", "tests.helpers.pause", str(marker), "16",
                               *cmd[1:]], tmp_path / "out.txt")
    wait_for_pause(proc, marker)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 75  # EXIT_PREEMPTED, no KeyError: no evaluation ran yet
    output = (tmp_path / "out.txt").read_text()
    assert "Traceback" not in output, output[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["metrics"] == {}
    assert f"stopped at step {summary['global_step']}; re-run" in output
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "val/mae" in again.stdout and "after 32 steps" in again.stdout


class DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features)


def test_custom_batches_through_forward_hook(tmp_path: Path) -> None:
    seed_everything(0)
    g = torch.Generator().manual_seed(0)
    batches = [{"features": torch.randn(8, 4, generator=g),
                "target": torch.randint(0, 2, (8,), generator=g), "ids": list(range(8))}
               for _ in range(6)]

    def forward(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return model(batch["features"]), batch["target"]

    model = DictModel()
    before = model.net.weight.detach().clone()
    trainer = Trainer(TrainerConfig(max_epochs=2, device="cpu", log_every_n_steps=1,
                                    accumulate_grad_batches=4),
                      run_dir=tmp_path, checkpoint=CheckpointConfig(resume=None))
    summary = trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), batches,
                          val_data=batches[:2], forward=forward)
    # 6 batches in windows of 4: one full window and one short one per epoch
    assert summary["global_step"] == 4 and summary["epoch"] == 2
    assert summary["metrics"]["val/loss"] > 0
    assert not torch.equal(before, model.net.weight)
    assert (tmp_path / "checkpoints" / "last.pt").is_file()


def test_trainer_without_run_dir_writes_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    model = nn.Linear(3, 2)
    data = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(3)]
    summary = Trainer(TrainerConfig(device="cpu")).fit(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data)
    assert summary["global_step"] == 3 and summary["metrics"] == {}
    assert list(tmp_path.iterdir()) == []
