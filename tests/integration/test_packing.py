"""``data=hf_text data.pack=true`` end to end: a tiny random-weight GPT-2 (128 positions) made
here trained fully on documents of 1 to 10 lines of Python's sources, once padded and once
packed, with as many optimizer steps per epoch: both reach the same validation loss (on the
same padded validation split) within :data:`TOLERANCE`; a packed run stopped by SIGTERM
mid-epoch and re-run ends bitwise as the uninterrupted one; both log real tokens per second."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import assert_same_weights, last_checkpoint, run_train
from tests.helpers.causal_lm import write_tokenizer
from tests.helpers.hf_text import code_lines

pytestmark = pytest.mark.slow

SEQ_LEN = 128
BATCH = 16  # padded: texts per step; packed: as many steps per epoch (windows per step)
EPOCHS = 3
# nats per token between the two runs' final validation losses: the seed-to-seed spread of the
# padded run alone here is about 0.03, the training's drop from ln(vocab) about 1
TOLERANCE = 0.1


def write_model(folder: Path) -> tuple[Path, Any]:
    """A random-weight ``GPT2LMHeadModel`` (2 layers, 64 wide, 128 positions) and its
    tokenizer."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = write_tokenizer(folder)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=SEQ_LEN, n_embd=64, n_layer=2,
                        n_head=2, bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    return folder, tokenizer


def write_documents(folder: Path, train: int = 256, test: int = 48) -> list[str]:
    """A saved ``DatasetDict`` of documents of 1 to 10 source lines (lengths varying ~10x)."""
    import datasets

    lines, docs, at = code_lines(), [], 0
    for i in range(train + test):
        k = 1 + i % 10
        docs.append("\n".join(lines[at:at + k]))
        at += k
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs[:train]}),
                          "test": datasets.Dataset.from_dict({"text": docs[train:]})}
                         ).save_to_disk(str(folder))
    return docs[:train]


def command(model: Path, data: Path, run_dir: Path, pack: bool, batch: int,
            *extra: str) -> list[str]:
    return ["+exp=finetune_text", "model.task=causal_lm", "model.lora=null",
            "checkpoint.adapters_only=false", f"model.path={model}", f"data.root={data}",
            f"hydra.run.dir={run_dir}", f"data.pack={str(pack).lower()}",
            f"data.batch_size={batch}", f"data.seq_len={SEQ_LEN}",
            f"trainer.max_epochs={EPOCHS}", "trainer.precision=32", "trainer.device=cpu",
            "trainer.log_every_n_steps=4", "optim.lr=2e-3", "sched.warmup_steps=2",
            "checkpoint.every_n_steps=8", "checkpoint.monitor=val/loss", "checkpoint.mode=min",
            *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The padded run, the packed run, and a packed run stopped by SIGTERM at step 20 (its
    second epoch) then re-run."""
    from trainkit.data.sources.packing import PackedWindows

    root = tmp_path_factory.mktemp("packing")
    model, tokenizer = write_model(root / "model")
    texts = write_documents(root / "data")
    windows = len(PackedWindows(texts, tokenizer, seq_len=SEQ_LEN))
    packed_batch = math.ceil(windows / BATCH)  # BATCH steps an epoch, as padded
    dirs = {name: root / name for name in ("padded", "packed", "cut")}
    for name, pack, batch, extra in (
            ("padded", False, BATCH, ()), ("packed", True, packed_batch, ()),
            ("cut", True, packed_batch, ("+callbacks.stop._target_=tests.helpers.callbacks"
                                         ".SigtermAt", "+callbacks.stop.step=20"))):
        proc = run_train(*command(model, root / "data", dirs[name], pack, batch, *extra))
        assert proc.returncode == (75 if name == "cut" else 0), proc.stdout[-3000:] + (
            proc.stderr[-3000:])
        assert "attention_mask" not in proc.stdout + proc.stderr  # transformers' advice, unsaid
    assert last_checkpoint(dirs["cut"])["global_step"] == 20
    proc = run_train(*command(model, root / "data", dirs["cut"], True, packed_batch))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"dirs": dirs, "vocab": len(tokenizer), "windows": windows, "texts": len(texts)}


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_packed_and_padded_runs_reach_the_same_validation_loss(runs: dict[str, Any]) -> None:
    padded, packed = (summary(runs["dirs"][name]) for name in ("padded", "packed"))
    assert padded["global_step"] == EPOCHS * BATCH
    assert abs(packed["global_step"] - padded["global_step"]) <= EPOCHS, packed["global_step"]
    a, b = padded["metrics"]["val/loss"], packed["metrics"]["val/loss"]
    untrained = math.log(runs["vocab"])
    assert a < untrained - 0.5 and b < untrained - 0.5, (untrained, a, b)  # both learned
    assert abs(a - b) < TOLERANCE, (a, b)
    log = (runs["dirs"]["packed"] / "train.log").read_text()
    assert f"data.pack: {runs['texts']} texts in {runs['windows']} windows of {SEQ_LEN}" in log


def test_both_modes_log_real_tokens_per_second(runs: dict[str, Any]) -> None:
    for name in ("padded", "packed"):
        rates = [m["throughput/tokens_per_s"] for m in metrics(runs["dirs"][name])
                 if "throughput/samples_per_s" in m]
        assert rates and all(r > 0 for r in rates), name
        assert "tokens/s" in (runs["dirs"][name] / "train.log").read_text()


def test_a_packed_run_stopped_mid_epoch_resumes_bitwise(runs: dict[str, Any]) -> None:
    a, b = last_checkpoint(runs["dirs"]["packed"]), last_checkpoint(runs["dirs"]["cut"])
    assert a["global_step"] == b["global_step"] == summary(runs["dirs"]["packed"])[
        "global_step"]
    assert_same_weights(a["model"], b["model"])
    for x, y in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert_same_weights(x, y)
    assert "resumed from" in (runs["dirs"]["cut"] / "train.log").read_text()
