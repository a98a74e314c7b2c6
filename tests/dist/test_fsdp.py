"""``trainer.strategy=fsdp`` under real torchrun (2 processes, gloo, CPU).

One torchrun start trains three library-API fits (fp32, bf16-mixed, 16-mixed; accumulation,
norm clipping, EMA and activation checkpointing on), compared with the same fits in one process
without sharding (tests/dist/fsdp_fit.py); one more start checks that a signal to one rank stops
both at one step through the entry point.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import REPO, offline_env
from tests.dist.test_torchrun import only_run_dir, overrides, torchrun
from tests.helpers.fakes import write_fake_mnist

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 192 training samples: 3 steps of 2 x 32 per epoch, so 2 epochs have an evaluation between
    return write_fake_mnist(tmp_path_factory.mktemp("fsdpdata"), n_train=192, n_test=255)


def _fits(out: Path, data_root: Path, *launcher: str) -> dict[str, Any]:
    command = [sys.executable, *launcher, "tests/dist/fsdp_fit.py", str(data_root), str(out)]
    proc = subprocess.run(command, cwd=REPO, env=offline_env(PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory, data_root: Path
         ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(one process, plain model; 2 ranks under fsdp), each per precision."""
    tmp = tmp_path_factory.mktemp("fsdpfits")
    single = _fits(tmp / "single.pt", data_root)
    sharded = _fits(tmp / "fsdp.pt", data_root, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node=2", "--monitor-interval=0.1")
    return single, sharded


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _norms(fit: dict[str, Any]) -> list[float]:
    return [m["optim/grad_norm"] for m in fit["logged"] if "optim/grad_norm" in m]


def test_two_ranks_fsdp_train_like_one_process(fits: tuple[dict, dict]) -> None:
    """fp32 with accumulation (2 micro-batches, no reduce-scatter on the first), norm clipping
    (norms ~1.2 > 0.5, so it clips every step), EMA, AdamW, weights kept gathered after forward,
    and an evaluation with the EMA weights after epoch 1: the same weights after 6 steps."""
    single, sharded = fits[0]["32"], fits[1]["32"]
    assert sharded["sharded"] and sharded["types"]["param"] == "DTensor"
    assert sharded["types"]["optimizer_param"] == "DTensor"  # the optimizer steps the shards
    assert single["types"]["param"] == "Parameter"
    assert sharded["summary"]["world_size"] == 2 and sharded["summary"]["global_step"] == 6
    for name, expected in single["weights"].items():
        torch.testing.assert_close(sharded["weights"][name], expected, rtol=1e-5, atol=5e-6,
                                   msg=name)
    for name, expected in single["ema"].items():
        torch.testing.assert_close(sharded["ema"][name], expected, rtol=1e-5, atol=5e-6,
                                   msg=name)
    # the logged norm is the unsharded gradient's, as a plain number, clipping active
    norms = _norms(sharded)
    assert len(norms) == 6 and all(type(n) is float and n > 0.5 for n in norms)
    assert norms == pytest.approx(_norms(single), rel=1e-5)
    # evaluation: rank 0 had 2 val batches, rank 1 one (it ran a second, uncounted forward for
    # rank 0's all-gathers), and the loss is the sum over all 255 samples
    assert sharded["val_batches"] == 2 and single["val_batches"] == 3
    assert sharded["summary"]["metrics"]["val/loss"] == pytest.approx(
        single["summary"]["metrics"]["val/loss"], rel=1e-5)


def test_each_rank_holds_half_of_the_weights_ema_and_optimizer_state(
        fits: tuple[dict, dict]) -> None:
    single, sharded = fits[0]["32"]["held"], fits[1]["32"]["held"]
    full = single["full"]
    assert single["params"] == single["ema"] == full and single["optimizer"] == 2 * full
    # FlatNet's tensors all have an even first dimension: exactly half each
    assert sharded["params"] == sharded["ema"] == full // 2
    assert sharded["optimizer"] == full  # AdamW's two moments, each half


def test_mixed_precision_under_fsdp_matches_one_process_loosely(fits: tuple[dict, dict]) -> None:
    """bf16/fp16 parameters and compute under FSDP (fp32 reduction and master weights) against
    autocast in one process. For scale: bf16 vs fp32 in one process differ by ~0.011 here."""
    single, sharded = fits
    for precision, tolerance in (("bf16-mixed", 0.02), ("16-mixed", 0.01)):
        got, expected = sharded[precision], single[precision]
        assert _max_difference(got["weights"], expected["weights"]) < tolerance, precision
        assert got["summary"]["metrics"]["val/loss"] == pytest.approx(
            expected["summary"]["metrics"]["val/loss"], rel=2e-3)
        assert got["summary"]["global_step"] == 6
    # the master weights stay float32; fp16's loss scaler ran (GradScaler on DTensor gradients)
    assert all(t.dtype == torch.float32 for t in sharded["bf16-mixed"]["weights"].values())
    assert "amp/loss_scale" in sharded["16-mixed"]["logged"][0]
    assert _max_difference(sharded["bf16-mixed"]["weights"], sharded["32"]["weights"]) > 1e-4


def test_sigterm_to_one_rank_stops_both_ranks_at_one_step_under_fsdp(
        data_root: Path, tmp_path: Path) -> None:
    """The per-step vote under fsdp: rank 1 gets SIGTERM in its 3rd forward, both stop after
    step 3 and exit with status 75."""
    outputs = tmp_path / "outputs"
    proc = torchrun(*overrides(outputs, data_root, "trainer.strategy=fsdp",
                               "checkpoint.every_n_steps=0", "+model.fault=sigterm",
                               "+model.fault_at=3"))
    run = only_run_dir(outputs, proc)
    assert proc.returncode != 0
    # torchrun reports the first rank to exit (it may stop the other before it exits itself)
    assert "exitcode  : 75" in proc.stderr, proc.stderr[-3000:]
    assert "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["global_step"] == 3
    log = (run / "train.log").read_text()
    assert "fsdp: Linear x2 (net.1, net.3) sharded over 2 ranks" in log
    assert log.count("stopped at step 3;") == 1, log[-2000:]  # rank 0's line
