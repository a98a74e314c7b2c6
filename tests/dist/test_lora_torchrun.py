"""+exp=finetune_text (LoRA through PEFT) under real torchrun, 2 processes, gloo: runs stopped
by SIGTERM on both ranks mid-epoch, one under DDP and one under FSDP, are re-run and resume from
their checkpoints to end bitwise where one uninterrupted 2-rank DDP run does, only the adapters
and the new head changed.

DDP's checkpoints keep the adapters alone (``checkpoint.adapters_only``); FSDP's keep every
weight, sharded (``adapters_only`` is refused under FSDP), read back consolidated. FSDP on CPU
in float32 trains bitwise as DDP does: both start from rank 0's weights, each rank sees the same
batches and dropout draws, gloo's sum of two ranks' gradients has no order to differ in, and
AdamW updates a shard element by element as it would the whole tensor. One uninterrupted run
(not one per strategy) is then the reference of both, which keeps this test to five launches.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, assert_same_weights, offline_env
from tests.helpers.hf_text import write_code_or_prose, write_tiny_bert
from trainkit.checkpoint.select import find_checkpoint, read_whole

pytestmark = pytest.mark.dist

STEPS = 12  # one epoch: 192 lines / (2 ranks x batch 8)
STOP = ("+callbacks.stop._target_=tests.helpers.callbacks.SigtermAt", "+callbacks.stop.step=5")
TRAINED = (".lora_", ".modules_to_save.")  # the adapters and the new head (PEFT's names)


def torchrun(model: Path, data: Path, run_dir: Path, strategy: str,
             *extra: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", "--monitor-interval=0.1", "-m", "trainkit.train",
               "+exp=finetune_text", f"model.path={model}", f"data.root={data}",
               f"hydra.run.dir={run_dir}", "data.batch_size=8", "trainer.max_epochs=1",
               "trainer.precision=32", "trainer.device=cpu", f"trainer.strategy={strategy}",
               f"checkpoint.adapters_only={strategy == 'ddp'}",
               "trainer.log_every_n_steps=2", "optim.lr=1e-2", "sched.warmup_steps=2", *extra]
    env = offline_env(TRAINKIT_DIST_TIMEOUT_S="60", OMP_NUM_THREADS="1",
                      HF_DATASETS_CACHE=str(run_dir.parent / "hf_cache"), HF_HUB_OFFLINE="1",
                      TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def completes(proc: subprocess.Popen[str]) -> None:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]


def is_preempted(proc: subprocess.Popen[str], run_dir: Path) -> None:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "exitcode  : 75" in out + err, out[-3000:] + err[-3000:]
    assert last(run_dir)["global_step"] == 5  # both ranks preempted, step 5 saved


def last(run_dir: Path) -> dict:
    """The run's last checkpoint: ``last.pt``, or FSDP's ``last/`` consolidated."""
    return read_whole(find_checkpoint(run_dir, "last"))


def test_lora_resumes_after_sigterm_under_ddp_and_fsdp_to_the_uninterrupted_weights(
        tmp_path: Path) -> None:
    model = write_tiny_bert(tmp_path / "bert")
    run = functools.partial(torchrun, model, write_code_or_prose(tmp_path / "data"))
    whole, ddp, fsdp = (tmp_path / name for name in ("whole", "ddp", "fsdp"))
    procs = run(whole, "ddp"), run(ddp, "ddp", *STOP)  # two launches at a time
    completes(procs[0])
    is_preempted(procs[1], ddp)
    procs = run(ddp, "ddp"), run(fsdp, "fsdp", *STOP)
    completes(procs[0])
    is_preempted(procs[1], fsdp)
    completes(run(fsdp, "fsdp"))

    for run_dir in (whole, ddp, fsdp):
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["world_size"] == 2, summary
        assert summary["global_step"] == STEPS
    for run_dir in (ddp, fsdp):
        assert "at step 5 (epoch 1, batch 5)" in (run_dir / "train.log").read_text()
    reference = last(whole)["model"]  # the adapters and the head alone
    assert reference and all(any(t in k for t in TRAINED) for k in reference), list(reference)
    assert_same_weights(reference, last(ddp)["model"])
    weights = last(fsdp)["model"]  # every weight
    assert_same_weights(reference, {k: v for k, v in weights.items() if k in reference})
    base = load_file(model / "model.safetensors")
    frozen = {k: base_name(k) for k in weights if k not in reference}
    assert set(frozen.values()) == set(base), set(base) ^ set(frozen.values())
    for key, name in frozen.items():  # as loaded
        assert torch.equal(weights[key], base[name]), key
    for key in (k for k in reference if ".lora_A." not in k):  # lora_A's start is random
        start = base.get(base_name(key), 0 * reference[key])  # the head's; lora_B's zeros
        assert not torch.equal(reference[key], start), key


def base_name(key: str) -> str:
    """The base model's name of a PEFT model's weight (``base_model.model.<name>``, a wrapped
    layer's ``.base_layer``, a trained module's ``.original_module`` / ``.modules_to_save.*``)."""
    name = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
    return name.replace(".original_module.", ".").replace(".modules_to_save.default.", ".")
