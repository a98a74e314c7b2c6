"""+exp=finetune_text (LoRA through PEFT) under real torchrun, 2 processes, gloo, DDP: a run
stopped by SIGTERM on both ranks mid-epoch and re-run resumes from its checkpoint of the
adapters alone and ends bitwise where an uninterrupted 2-rank run does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, assert_same_weights, last_checkpoint, offline_env
from tests.helpers.hf_text import write_code_or_prose, write_tiny_bert

pytestmark = pytest.mark.dist

STEPS = 12  # one epoch: 192 lines / (2 ranks x batch 8)


def torchrun(model: Path, data: Path, run_dir: Path, *extra: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", "--monitor-interval=0.1", "-m", "trainkit.train",
               "+exp=finetune_text", f"model.path={model}", f"data.root={data}",
               f"hydra.run.dir={run_dir}", "data.batch_size=8", "trainer.max_epochs=1",
               "trainer.precision=32", "trainer.device=cpu", "trainer.strategy=ddp",
               "trainer.log_every_n_steps=2", "optim.lr=1e-2", "sched.warmup_steps=2", *extra]
    env = offline_env(TRAINKIT_DIST_TIMEOUT_S="60", OMP_NUM_THREADS="1",
                      HF_DATASETS_CACHE=str(run_dir.parent / "hf_cache"), HF_HUB_OFFLINE="1",
                      TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out[-3000:] + err[-3000:]


def test_lora_with_ddp_resumes_after_sigterm_to_the_same_adapters(tmp_path: Path) -> None:
    model = write_tiny_bert(tmp_path / "bert")
    data = write_code_or_prose(tmp_path / "data")
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    procs = (torchrun(model, data, whole),
             torchrun(model, data, cut, "+callbacks.stop._target_=tests.helpers.callbacks."
                      "SigtermAt", "+callbacks.stop.step=5"))
    (status, out), (cut_status, cut_out) = finish(procs[0]), finish(procs[1])
    assert status == 0, out
    assert cut_status != 0 and "exitcode  : 75" in cut_out, cut_out  # both ranks preempted
    assert last_checkpoint(cut)["global_step"] == 5
    status, out = finish(torchrun(model, data, cut))
    assert status == 0, out
    assert "at step 5 (epoch 1, batch 5)" in (cut / "train.log").read_text()

    for run_dir in (whole, cut):
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["world_size"] == 2, summary
        assert summary["global_step"] == STEPS
    a, b = last_checkpoint(whole), last_checkpoint(cut)
    assert all(".lora_" in k or ".modules_to_save." in k for k in a["model"]), list(a["model"])
    assert_same_weights(a["model"], b["model"])
