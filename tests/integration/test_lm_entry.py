"""+exp=lm through the real entry point: a corpus written by `python -m trainkit.data tokenize`,
a small GPT that learns it (validation loss well below the corpus's unigram entropy), its
z-loss, perplexity, tokens/s and samples in the logs and TensorBoard, and a SIGTERM mid-run then
a re-run that ends bitwise where an uninterrupted run ends."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import (
    Started,
    assert_same_weights,
    error_report,
    last_checkpoint,
    offline_env,
    run_module,
    run_train,
    start_module,
)
from trainkit.entry import cli

pytestmark = pytest.mark.slow

# 120 steps of a 2-layer GPT of width 64 on windows of 64 bytes: ~10 s of training on one core
LM = ["data.seq_len=64", "data.batch_size=16", "data.eval_batch_size=16", "model.dim=64",
      "model.layers=2", "trainer.max_steps=120", "trainer.eval_every_n_steps=40",
      "trainer.eval_max_batches=4", "trainer.log_every_n_steps=20", "trainer.precision=32",
      "sched.warmup_steps=10", "optim.lr=1e-2", "checkpoint.every_n_steps=1000",
      "callbacks.sample.length=20"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The standard library's json, email and a few more modules' sources, tokenized as bytes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("lm") / "corpus"
    proc = run_module("trainkit.data", "tokenize", str(stdlib / "json"),
                      str(stdlib / "argparse.py"), str(stdlib / "textwrap.py"), str(out),
                      "--tokenizer", "bytes", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def unigram_entropy(path: Path) -> float:
    """The entropy of the file's token frequencies, in nats: what a model that ignores context
    (predicting each token by its frequency alone) reaches at best."""
    counts = np.bincount(np.fromfile(path, dtype=np.uint16))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def start(run_dir: Path, corpus: Path, *extra: str) -> Started:
    # one thread each: two runs side by side on 2 shared cores
    return start_module("trainkit.train", "+exp=lm", f"data.root={corpus}",
                        f"hydra.run.dir={run_dir}", *LM, *extra,
                        env=offline_env(OMP_NUM_THREADS="1"))


def finish(proc: Started, status: int) -> str:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == status, (proc.returncode, out[-2000:], err[-2000:])
    return out


def evaluations(run_dir: Path) -> dict[int, float]:
    lines = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {line["step"]: line["val/loss"] for line in lines if "val/loss" in line}


def test_lm_learns_logs_its_scalars_and_resumes_bitwise_after_sigterm(
        tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    procs = (start(whole, corpus),
             start(cut, corpus, "+callbacks.stop._target_=tests.helpers.callbacks.SigtermAt",
                   "+callbacks.stop.step=60"))
    out_whole, out_cut = finish(procs[0], 0), finish(procs[1], 75)
    assert last_checkpoint(cut)["global_step"] == 60
    out_resumed = finish(start(cut, corpus), 0)

    # learned: well below what token frequencies alone give
    entropy = unigram_entropy(corpus / "train.bin")
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 120
    val_loss = summary["metrics"]["val/loss"]
    assert val_loss < 0.75 * entropy, (val_loss, entropy)  # ~0.67 (2.56 against 3.84 nats)
    assert summary["metrics"]["val/perplexity"] == pytest.approx(np.exp(val_loss), rel=1e-4)

    # the preempted run, re-run, ends where the uninterrupted one does, bit for bit
    assert_same_weights(last_checkpoint(whole)["model"], last_checkpoint(cut)["model"])
    assert evaluations(whole) == evaluations(cut) and list(evaluations(whole)) == [40, 80, 120]
    samples = [[line for line in out.splitlines() if line.startswith("sample at step")]
               for out in (out_whole, out_cut, out_resumed)]
    assert len(samples[0]) == 3 and samples[0] == samples[1] + samples[2]

    # z-loss, tokens/s and perplexity in TensorBoard; tokens/s in the log line
    events = EventAccumulator(str(whole / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/z_loss", "throughput/tokens_per_s", "val/perplexity"} <= tags, tags
    rates = [e.value for e in events.Scalars("throughput/tokens_per_s")]
    samples_s = [e.value for e in events.Scalars("throughput/samples_per_s")]
    assert rates == pytest.approx([64 * s for s in samples_s])  # seq_len tokens per window
    assert " tokens/s data wait " in (whole / "train.log").read_text()
    assert "done: val/loss" in (whole / "train.log").read_text()

    # after training: predict and export take image models, and say so in one line
    for command in (["export", str(whole)], ["predict", str(whole), "inputs=test",
                                             f"out={tmp_path / 'rows.jsonl'}"]):
        with pytest.raises(SystemExit) as stop:
            cli.main(command)
        assert stop.value.code == 2
        assert "trained a language model on tokens" in error_report(capsys.readouterr().err)[1]


def test_model_smaller_than_the_corpus_vocabulary_is_one_line(tmp_path: Path,
                                                              corpus: Path) -> None:
    proc = run_train("+exp=lm", f"data.root={corpus}", f"hydra.run.dir={tmp_path / 'run'}",
                     "model.vocab_size=100", *LM, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "trainkit: model.vocab_size=100 but the data's tokens go up to 256: set "
        "model.vocab_size=256")
    assert not (tmp_path / "run").exists()
