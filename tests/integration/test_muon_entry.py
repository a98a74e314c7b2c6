"""+exp=lm optim=muon sched=wsd through the real entry point: Muon's and AdamW's state in one
checkpoint, a SIGTERM mid-run then a re-run that ends bitwise where an uninterrupted run ends,
and the one-line refusal under FSDP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import (
    REPO,
    Started,
    assert_same_weights,
    error_report,
    last_checkpoint,
    offline_env,
    start_module,
)
from trainkit.data.tools.tokenize import tokenize

pytestmark = pytest.mark.slow

LM = ["+exp=lm", "optim=muon", "sched=wsd", "data.seq_len=32", "data.batch_size=8",
      "data.eval_batch_size=8", "model.dim=32", "model.layers=1", "trainer.max_steps=16",
      "trainer.eval_every_n_steps=8", "trainer.eval_max_batches=2",
      "trainer.log_every_n_steps=4", "trainer.precision=32", "sched.warmup_steps=2",
      "sched.decay_fraction=0.25", "checkpoint.every_n_steps=1000", "callbacks.sample=null"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This test file and the Muon module, tokenized as bytes (~10 KB)."""
    out = tmp_path_factory.mktemp("muon") / "corpus"
    tokenize([Path(__file__), REPO / "trainkit" / "models" / "muon.py"], out, "bytes")
    return out


def start(run_dir: Path, corpus: Path, *extra: str) -> Started:
    return start_module("trainkit.train", f"data.root={corpus}", f"hydra.run.dir={run_dir}",
                        *LM, *extra, env=offline_env(OMP_NUM_THREADS="1"))


def finish(proc: Started, status: int) -> str:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == status, (proc.returncode, out[-2000:], err[-2000:])
    return out


def test_muon_with_wsd_trains_and_resumes_bitwise_after_sigterm(tmp_path: Path,
                                                                corpus: Path) -> None:
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    procs = (start(whole, corpus),
             start(cut, corpus, "+callbacks.stop._target_=tests.helpers.callbacks.SigtermAt",
                   "+callbacks.stop.step=8"))
    out, _ = finish(procs[0], 0), finish(procs[1], 75)
    assert "2 groups: default.muon lr " in out and "no_decay.adamw lr " in out
    stopped = last_checkpoint(cut)
    assert stopped["global_step"] == 8
    # one optimizer's state: Muon's momentum for the 4 hidden matrices, AdamW's moments for
    # the embeddings, norms and biases, in the groups' order
    state, groups = stopped["optimizer"]["state"], stopped["optimizer"]["param_groups"]
    assert [g["name"] for g in groups] == ["default.muon", "no_decay.adamw"]
    assert [set(state[i]) for i in groups[0]["params"]] == [{"momentum_buffer"}] * 4
    assert all({"exp_avg", "exp_avg_sq", "step"} <= set(state[i]) for i in groups[1]["params"])
    finish(start(cut, corpus), 0)
    assert_same_weights(last_checkpoint(whole)["model"], last_checkpoint(cut)["model"])
    lines = [json.loads(x) for x in (whole / "metrics.jsonl").read_text().splitlines()]
    lrs = {x["step"]: x["train/lr"] for x in lines if "train/lr" in x}
    assert lrs[8] == lrs[12] > lrs[16]  # stable, then the last quarter decays


def test_muon_under_fsdp_is_refused_in_one_line(tmp_path: Path, corpus: Path) -> None:
    proc = start(tmp_path / "run", corpus, "trainer.strategy=fsdp")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, (out[-2000:], err[-2000:])
    assert "optim=muon runs in one process or under trainer.strategy=ddp" in \
        error_report(err)[1]
    assert not (tmp_path / "run").exists()
