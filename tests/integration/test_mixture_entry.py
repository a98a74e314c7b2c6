"""``data.mix`` through the real entry point: two token corpora mixed 3:1 under ``+exp=lm``; the
first line states the mixture, each corpus's validation loss is logged as ``val/loss/<name>``
(metrics.jsonl, TensorBoard), and a SIGTERM mid-epoch then a re-run ends bitwise where the
uninterrupted run ends."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import assert_same_weights, last_checkpoint, run_train

pytestmark = pytest.mark.slow

# 30 steps of a 1-layer GPT of width 32 on windows of 32 tokens (an epoch: ~470 batches)
LM = ["data.seq_len=32", "data.batch_size=8", "data.eval_batch_size=8", "model.dim=32",
      "model.layers=1", "trainer.max_steps=30", "trainer.eval_every_n_steps=10",
      "trainer.eval_max_batches=2", "trainer.log_every_n_steps=5", "trainer.precision=32",
      "sched.warmup_steps=2", "checkpoint.every_n_steps=1000", "~callbacks.sample"]


def corpus(folder: Path, n: int, seed: int) -> Path:
    """A byte-level corpus of ``n`` tokens: a repeated random phrase (something to learn)."""
    rng = np.random.default_rng(seed)
    phrase = rng.integers(0, 256, 50)
    folder.mkdir(parents=True)
    for split, size in (("train", n), ("val", n // 8)):
        np.resize(phrase, size).astype(np.uint16).tofile(folder / f"{split}.bin")
    (folder / "meta.json").write_text('{"vocab_size": 256, "dtype": "uint16"}')
    return folder


def evaluations(run_dir: Path) -> list[dict[str, float]]:
    lines = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [line for line in lines if "val/loss" in line]


def test_a_mixture_logs_each_corpus_and_resumes_bitwise_after_sigterm(tmp_path: Path) -> None:
    prose, code = corpus(tmp_path / "prose", 100_000, 0), corpus(tmp_path / "code", 20_000, 1)
    mix = f"data.mix=[{{root: '{prose}', weight: 3}}, {{root: '{code}', weight: 1, name: py}}]"

    def train(run_dir: Path, status: int, *extra: str) -> None:
        done = run_train("+exp=lm", mix, f"hydra.run.dir={run_dir}", *LM, *extra)
        assert done.returncode == status, done.stderr[-3000:]

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train(whole, 0)
    train(cut, 75, "+callbacks.stop._target_=tests.helpers.callbacks.SigtermAt",
          "+callbacks.stop.step=15")
    assert last_checkpoint(cut)["global_step"] == 15
    train(cut, 0)

    # the first line states the weights and each corpus's size
    first = (whole / "train.log").read_text().splitlines()[0]
    assert first.endswith("data.mix: prose weight 0.75 (100,000 tokens, 3,124 windows of 32), "
                          "py weight 0.25 (20,000 tokens, 624 windows of 32)"), first
    # each corpus's validation loss, beside the whole's, at every evaluation
    evals = evaluations(whole)
    assert [e["step"] for e in evals] == [10, 20, 30]
    assert all({"val/loss/prose", "val/loss/py"} <= set(e) for e in evals)
    assert evals[-1]["val/loss/prose"] != evals[-1]["val/loss/py"]
    events = EventAccumulator(str(whole / "tb"))
    events.Reload()
    assert {"val/loss/prose", "val/loss/py"} <= set(events.Tags()["scalars"])
    # the preempted run, re-run, ends where the uninterrupted one does, bit for bit
    assert_same_weights(last_checkpoint(whole)["model"], last_checkpoint(cut)["model"])
    assert evaluations(cut) == evals
