"""optim=muon under real torchrun (2 processes, gloo, DDP) trains as 1 process accumulating 2
micro-batches of the same size: Muon's and AdamW's updates from the same averaged gradient."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import run_train
from tests.dist.test_torchrun import only_run_dir, overrides, torchrun, weights
from tests.helpers.fakes import write_fake_mnist

pytestmark = pytest.mark.dist

MUON = ["optim=muon", "optim.lr=0.02", "optim.adamw_params=[net.3.*]"]


def test_two_ranks_with_muon_train_like_one_process_accumulating_two(tmp_path: Path) -> None:
    data_root = write_fake_mnist(tmp_path / "data", n_train=512, n_test=64)
    two = torchrun(*overrides(tmp_path / "two", data_root, *MUON))
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    one = run_train(*overrides(tmp_path / "one", data_root, *MUON,
                               "trainer.accumulate_grad_batches=2"))
    assert one.returncode == 0, one.stderr[-3000:]
    two_run, one_run = only_run_dir(tmp_path / "two", two), only_run_dir(tmp_path / "one", one)
    log = (two_run / "train.log").read_text()
    assert "global batch 32 = batch 16 x accumulate 1 x world size 2" in log
    assert "default.muon lr " in log and "default.adamw lr " in log  # net.3: adamw_params
    # what a different gradient does: one process on one rank's share (batch 16, no
    # accumulation), the run DDP would give if it did not average the two ranks' gradients
    half = run_train(*overrides(tmp_path / "half", data_root, *MUON))
    assert half.returncode == 0, half.stderr[-3000:]
    got, expected = weights(two_run), weights(one_run)
    other = weights(only_run_dir(tmp_path / "half", half))
    start = torch.load(one_run / "checkpoints" / "step_000000002.pt", weights_only=True)["model"]
    for name in got:
        moved = (expected[name] - start[name]).abs().max()
        apart = (got[name] - expected[name]).abs().max()
        # Muon orthogonalises in bfloat16 through Newton-Schulz steps that amplify small
        # differences: the two float32 gradient sums' last bits show, so the weights agree to
        # a small part of the last 4 steps' movement and far closer than another gradient's
        assert apart <= 0.1 * moved, (name, apart, moved)
        assert (other[name] - expected[name]).abs().max() > 5 * apart, name


def test_torchs_muon_on_fsdp2_shards_is_not_the_unsharded_update(tmp_path: Path) -> None:
    """Why optim=muon is refused under FSDP: torch's Muon runs on the shards (DTensors) but
    updates differently. When this fails, torch shards Muon: lift the refusal."""
    out = tmp_path / "step.pt"
    proc = torchrun(str(out), module="tests.dist.muon_fsdp_step")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    step = torch.load(out, weights_only=True)
    assert step["apart"] > 0.1 * step["update"], step  # far beyond bfloat16 rounding
