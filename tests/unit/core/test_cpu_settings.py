"""The allocator setting CPU runs get (trainkit.core.cpu_settings)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from trainkit import Trainer, TrainerConfig
from trainkit.config import CheckpointConfig

pytestmark = pytest.mark.serial  # page faults counted: run alone (see pyproject.toml)

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

FAULTS = """
import resource, sys, torch
torch.manual_seed(0)
if sys.argv[1] == "keep":
    from trainkit.core.cpu_settings import keep_freed_memory
    assert keep_freed_memory() == "freed memory kept for reuse"
from trainkit.models import MnistNet
model = MnistNet()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(128, 1, 28, 28), torch.randint(0, 10, (128,))
def step():
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
for _ in range(5):  # the heap grows to its working size
    step()
# over many steps: a one-off growth of the heap later on (~600 pages, now and then) is not what
# is measured, the faults of every step are
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


def _faults_per_step(mode: str) -> float:
    result = subprocess.run([sys.executable, "-c", FAULTS, mode], cwd=REPO, capture_output=True,
                            text=True, timeout=120, check=True)
    return float(result.stdout.split()[-1])


@glibc
def test_a_training_step_reuses_freed_memory_instead_of_faulting_it_in() -> None:
    # With glibc's defaults each step of a small convnet page-faults hundreds of pages of its
    # activations in again (~1,000 here at batch 128; at 64 most of them fit under glibc's
    # mmap threshold); kept, the steps reuse them (0 here).
    default, kept = _faults_per_step("default"), _faults_per_step("keep")
    assert default > 300, default
    assert kept < default / 10, (kept, default)


@glibc
@pytest.mark.parametrize("keep", [True, False])
def test_the_first_log_line_says_whether_the_setting_is_on(keep: bool, tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    trainer = Trainer(TrainerConfig(device="cpu", cpu_keep_freed_memory=keep), run_dir=tmp_path,
                      checkpoint=CheckpointConfig(resume=None, save_last=False))
    batches = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), batches)
    first = (tmp_path / "train.log").read_text().splitlines()[0]
    assert "training Linear on cpu" in first
    assert ("freed memory kept for reuse" in first) == keep
