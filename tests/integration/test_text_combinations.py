"""The language-model options combined: an all-pairs covering set of ``data=hf_text`` causal-LM
runs, each stopped by a real SIGTERM mid-epoch and resumed.

Packing, mixtures, accumulation, micro-batches, Muon, WSD, bf16-mixed and clipping each work
alone (their own tests); what breaks is a combination. The rows come from
:func:`tests.dist.test_combinations.pairwise` over :data:`FACTORS`: every pair of option values
occurs in some row. Each row trains a tiny random-weight GPT-2 made here (``Conv1D`` layers, its
output layer tied to the token embeddings) through the real entry point, once uninterrupted and
once stopped by SIGTERM mid-epoch then re-run: the re-run must end with the same weights and
optimizer state, bit for bit, and the same evaluations; metrics.jsonl holds ``val/loss`` (and
``val/loss/<name>`` per corpus when mixed). The fits run one after another in one process
(tests/helpers/entry_runs.py: transformers and datasets imported once, not once a fit).
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import run_train_many
from tests.dist.test_combinations import pairwise
from tests.helpers.causal_lm import write_tokenizer
from tests.helpers.hf_text import code_lines, prose_lines

pytestmark = pytest.mark.slow

# Each option with the values the runs take; a new option joins the pairwise set with one line.
FACTORS: dict[str, list[Any]] = {
    "pack": [False, True],  # data.pack: documents packed into data.seq_len windows
    "mix": [False, True],  # data.mix: code and prose 3:1, else code alone
    "accumulate": [1, 2],  # trainer.accumulate_grad_batches
    "micro_batch": [False, True],  # trainer.micro_batch_size=2: each batch in two halves
    "optim": ["adamw", "muon"],
    "sched": ["warmup_cosine", "wsd"],
    "precision": ["32", "bf16-mixed"],
    "clip": [False, True],  # trainer.gradient_clip_val=0.5
}
ROWS = pairwise(FACTORS)

SEQ_LEN, BATCH, STEPS, STOP = 64, 4, 6, 3  # every epoch longer than STEPS optimizer steps
TRAIN, TEST = 192, 16  # documents per corpus: lines of 11 to 50 tokens, ~2 to a packed window


def _row_id(row: dict[str, Any]) -> str:
    words = {"accumulate": {1: "", 2: "acc2"}}
    return "-".join(w for w in (words.get(k, {}).get(v, k if v is True else str(v))
                                for k, v in row.items() if v is not False) if w)


def test_the_rows_cover_every_pair_of_option_values() -> None:
    for a, b in itertools.combinations(FACTORS, 2):
        seen = {(row[a], row[b]) for row in ROWS}
        assert seen == set(itertools.product(FACTORS[a], FACTORS[b])), (a, b)
    assert len(ROWS) <= 9  # vs 2**8 = 256 combinations


def _write_corpus(folder: Path, docs: list[str]) -> Path:
    """A saved ``DatasetDict``: the first :data:`TRAIN` of ``docs`` to train, the next
    :data:`TEST` to evaluate."""
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs[:TRAIN]}),
                          "test": datasets.Dataset.from_dict({"text": docs[TRAIN:TRAIN + TEST]})}
                         ).save_to_disk(str(folder))
    return folder


def _write_model(folder: Path) -> Path:
    """A random-weight ``GPT2LMHeadModel`` (2 layers, 32 wide, :data:`SEQ_LEN` positions, its
    ``lm_head`` tied to ``wte``) and its tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = write_tokenizer(folder, vocab_size=384)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=SEQ_LEN, n_embd=32, n_layer=2,
                        n_head=2, bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def _overrides(row: dict[str, Any], model: Path, code: Path, prose: Path,
               run_dir: Path) -> list[str]:
    mix = (f"data.mix=[{{root: '{code}', weight: 3}}, {{root: '{prose}', weight: 1}}]"
           if row["mix"] else f"data.root={code}")
    return ["+exp=finetune_text", "model.task=causal_lm", "model.lora=null",
            "checkpoint.adapters_only=false", f"model.path={model}", mix,
            f"hydra.run.dir={run_dir}", f"data.pack={str(row['pack']).lower()}",
            f"data.batch_size={BATCH}", "data.eval_batch_size=8", f"data.seq_len={SEQ_LEN}",
            "trainer.max_epochs=null", f"trainer.max_steps={STEPS}",
            f"trainer.eval_every_n_steps={STEPS}", "trainer.eval_max_batches=2",
            f"trainer.accumulate_grad_batches={row['accumulate']}",
            f"trainer.micro_batch_size={2 if row['micro_batch'] else 'null'}",
            f"trainer.gradient_clip_val={0.5 if row['clip'] else 'null'}",
            f"trainer.precision={row['precision']}", "trainer.device=cpu",
            "trainer.log_every_n_steps=2", f"optim={row['optim']}", "optim.lr=3e-3",
            f"sched={row['sched']}", "sched.warmup_steps=2", "checkpoint.every_n_steps=1000",
            "checkpoint.monitor=val/loss", "checkpoint.mode=min"]


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every row's uninterrupted fit, its fit stopped by SIGTERM at step :data:`STOP`, and that
    fit's re-run, in one process; the statuses, run dirs and the log of the runs."""
    root = tmp_path_factory.mktemp("text_combinations")
    model = _write_model(root / "model")
    code = _write_corpus(root / "code", code_lines())
    prose = _write_corpus(root / "prose", [" ".join(ln.split()[:6]) for ln in prose_lines()])
    runs: dict[str, list[str]] = {}
    for row in ROWS:
        name = _row_id(row)
        runs[f"{name}.whole"] = _overrides(row, model, code, prose, root / name / "whole")
        cut = _overrides(row, model, code, prose, root / name / "cut")
        runs[f"{name}.cut"] = [*cut, "+callbacks.stop._target_=tests.helpers.callbacks.SigtermAt",
                               f"+callbacks.stop.step={STOP}"]
        runs[f"{name}.resumed"] = cut
    return {"root": root, "done": run_train_many(runs, root / "outputs", timeout=900)}


def _checkpoint(run_dir: Path) -> dict[str, Any]:
    return torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu",
                      weights_only=True)


def _evaluations(run_dir: Path) -> list[dict[str, Any]]:
    lines = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [line for line in lines if "val/loss" in line]


def _assert_equal_trees(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_equal_trees(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal_trees(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("row", ROWS, ids=_row_id)
def test_a_preempted_and_resumed_text_run_ends_as_the_uninterrupted_one(
        row: dict[str, Any], fits: dict[str, Any]) -> None:
    name, done = _row_id(row), fits["done"]
    for fit, status in (("whole", 0), ("cut", 75), ("resumed", 0)):
        proc = done[f"{name}.{fit}"]
        assert proc.returncode == status, (fit, proc.stdout[-2000:] + proc.stderr[-3000:])
    whole, cut = fits["root"] / name / "whole", fits["root"] / name / "cut"
    # stopped mid-epoch (an epoch is longer than the run), resumed there
    log = (cut / "train.log").read_text()
    assert (f"at step {STOP} (epoch 1, batch {STOP * row['accumulate']})" in
            log.split("resumed from ", 1)[1].splitlines()[0]), log
    # the re-run ends bitwise as the uninterrupted run: weights, optimizer state (Muon's
    # momentum, AdamW's moments), schedule, evaluations
    a, b = _checkpoint(whole), _checkpoint(cut)
    assert a["global_step"] == b["global_step"] == STEPS
    for part in ("model", "optimizer", "scheduler", "precision"):
        _assert_equal_trees(b[part], a[part], part)
    evals = _evaluations(whole)
    assert [e["step"] for e in evals] == [STEPS] and evals[0]["val/loss"] > 0
    assert _evaluations(cut) == evals
    # each option took effect
    parts = {"val/loss/code", "val/loss/prose"}
    assert parts <= set(evals[0]) if row["mix"] else not parts & set(evals[0])
    packed = [line for line in log.splitlines() if " data.pack: " in line]
    assert len(packed) == (2 * (1 + row["mix"]) if row["pack"] else 0)  # each part packed
    for line in packed:  # ~2 documents a window
        texts, windows = map(int, re.findall(r"(\d+) texts in (\d+) windows", line)[0])
        assert windows < 0.75 * texts, line
    assert f"precision {row['precision']}," in log
    assert ("micro-batches of 2 samples" in log) == row["micro_batch"]
    groups = a["optimizer"]["param_groups"]
    if row["optim"] == "muon":  # GPT-2's 8 Conv1D matrices; embeddings (tied), norms, biases
        assert [(g["name"], len(g["params"])) for g in groups] == [
            ("default.muon", 8), ("default.adamw", 20)]
        state = a["optimizer"]["state"]
        assert all(set(state[i]) == {"momentum_buffer"} for i in groups[0]["params"])
    else:
        assert len(groups) == 1
    lrs = {m["step"]: m["train/lr"] for m in map(json.loads, (
        whole / "metrics.jsonl").read_text().splitlines()) if "train/lr" in m}
    if row["sched"] == "wsd":  # warmed up by step 2, stable, decayed in the last step
        assert lrs[2] == lrs[4] > lrs[6], lrs
    else:
        assert lrs[2] > lrs[4] > lrs[6], lrs
