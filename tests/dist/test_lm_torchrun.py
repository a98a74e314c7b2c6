"""+exp=lm under real torchrun, 2 processes, gloo: each rank reads its own windows of the token
corpus, evaluation splits the validation file between them, rank 0 alone prints samples."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import REPO, offline_env
from trainkit.data.tools.tokenize import tokenize

pytestmark = pytest.mark.dist


def test_lm_trains_under_torchrun_with_two_ranks(tmp_path: Path) -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = tmp_path / "corpus"
    tokenize([stdlib / "textwrap.py", stdlib / "argparse.py"], corpus, "bytes")
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", "--monitor-interval=0.1", "-m", "trainkit.train", "+exp=lm",
               f"data.root={corpus}", f"hydra.run.dir={run_dir}", "data.seq_len=32",
               "data.batch_size=8", "data.eval_batch_size=8", "model.dim=32", "model.layers=1",
               "trainer.max_steps=12", "trainer.eval_every_n_steps=6",
               "trainer.eval_max_batches=2", "trainer.log_every_n_steps=6",
               "trainer.precision=32", "sched.warmup_steps=2", "callbacks.sample.length=8"]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240,
                          env=offline_env(TRAINKIT_DIST_TIMEOUT_S="60", OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert summary["global_step"] == 12 and "val/perplexity" in summary["metrics"]
    assert proc.stdout.count("sample at step") == 2  # rank 0 alone, after each evaluation
    log = (run_dir / "train.log").read_text()
    assert "global batch 16 = batch 8 x accumulate 1 x world size 2" in log
    assert " tokens/s data wait " in log
