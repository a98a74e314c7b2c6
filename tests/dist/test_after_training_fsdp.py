"""``trainkit evaluate``, ``export`` and ``predict`` of a 2-rank FSDP run (real torchrun, gloo):
one process reads the sharded checkpoint whole (no consolidate step), two ranks share the
work and agree with it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, offline_env, tiny_run
from tests.integration.test_after_training import write_pngs
from trainkit import load_model
from trainkit.checkpoint.consolidate import load_full
from trainkit.data.sources.tensors import load_mnist
from trainkit.entry import cli
from trainkit.entry.evaluate import evaluate_run
from trainkit.entry.export import export_run

pytestmark = [pytest.mark.slow, pytest.mark.dist]


def torchrun(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m <module> <args>`` on 2 ranks under torchrun."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", "--max-restarts=0", "--monitor-interval=0.1", "-m", module,
               *args]
    return subprocess.run(command, cwd=REPO, env=offline_env(TRAINKIT_DIST_TIMEOUT_S="60"),
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory, mnist_root: Path) -> Path:
    run = tmp_path_factory.mktemp("fsdp")
    result = torchrun("trainkit.train", *tiny_run(run, mnist_root, "model.widths=[8,16,32]",
                                                  "trainer.strategy=fsdp",
                                                  "trainer.max_steps=4"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run / "checkpoints" / "last" / ".metadata").is_file()  # sharded
    return run


def test_evaluate_in_one_process_and_on_two_ranks_equals_the_runs_evaluation(
        fsdp_run: Path) -> None:
    recorded = json.loads((fsdp_run / "summary.json").read_text())["metrics"]
    alone = evaluate_run(fsdp_run, "last")["metrics"]
    result = torchrun("trainkit.entry.evaluate", str(fsdp_run), "ckpt=last")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("last (step 4, raw weights)") == 1  # rank 0 alone prints
    shared = json.loads((fsdp_run / "eval_last.json").read_text())
    assert shared["world_size"] == 2
    for results in (alone, shared["metrics"]):
        assert results["val/acc"] == recorded["val/acc"]  # counts: exact
        # the loss is summed in another order across ranks: equal to float32 rounding
        assert results["val/loss"] == pytest.approx(recorded["val/loss"], rel=1e-6)


def test_export_reads_the_sharded_checkpoint_without_a_consolidate_step(
        fsdp_run: Path, tmp_path: Path) -> None:
    out = export_run([str(fsdp_run), "ckpt=last"], fmt="pt", out=tmp_path / "export")
    exported = torch.load(out / "model.pt", weights_only=True)
    whole = load_full(fsdp_run / "checkpoints" / "last")["model"]
    assert exported.keys() == whole.keys()
    assert all(torch.equal(exported[name], whole[name]) for name in whole)
    model = load_model(out)
    assert all(torch.equal(t, whole[n]) for n, t in model.state_dict().items())


def test_predict_on_two_ranks_writes_the_rows_of_one_process_in_order(
        fsdp_run: Path, mnist_root: Path, tmp_path: Path) -> None:
    images = load_mnist(mnist_root, train=False, verify=False, download=False).images[:50]
    folder = write_pngs(images, tmp_path / "images")
    alone, shared = tmp_path / "alone.jsonl", tmp_path / "shared.jsonl"
    assert cli.main(["predict", str(fsdp_run), f"inputs={folder}", f"out={alone}"]) == 0
    result = torchrun("trainkit.entry.predict", str(fsdp_run), f"inputs={folder}",
                      f"out={shared}")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in shared.read_text().splitlines()]
    assert len(rows) == 50
    assert [row["input"] for row in rows] == sorted(str(p) for p in folder.iterdir())
    assert shared.read_text() == alone.read_text()
