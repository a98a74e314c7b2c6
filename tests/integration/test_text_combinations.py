"""The language-model options combined: an all-pairs covering set of ``data=hf_text`` causal-LM
runs, each stopped by a real SIGTERM mid-epoch and resumed.

Packing, mixtures, accumulation, micro-batches, Muon, WSD, mixed precision, clipping, loader
workers each work alone (their own tests); what breaks is a combination. The rows come from
:func:`tests.dist.test_combinations.pairwise` over :data:`FACTORS`: every pair of option values
occurs in some row (11 rows for 10 options). Each row trains a tiny random-weight GPT-2
(``Conv1D`` layers) or Llama (``nn.Linear``) made here, its output layer tied to the token
embeddings, through the real entry point, once uninterrupted and once stopped by a real SIGTERM
mid-epoch then re-run: the re-run must end with the same weights, optimizer state (Muon's and
AdamW's), schedule and evaluations, bit for bit; metrics.jsonl holds ``val/loss`` (and
``val/loss/<name>`` per corpus when mixed), and each option shows that it took effect. One step
split by accumulation or micro-batches is the unsplit step, packed or padded, mixed. The fits run
in one process (:func:`tests.conftest.run_train_many`: transformers imported once, not a fit).
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
    "model": ["gpt2", "llama"],  # GPT-2's Conv1D layers; Llama's nn.Linear, rotary positions
    "pack": [False, True],  # data.pack: documents packed into data.seq_len windows
    "mix": [False, True],  # data.mix: code and prose 3:1, else code alone
    "accumulate": [1, 2],  # trainer.accumulate_grad_batches
    "micro_batch": [False, True],  # trainer.micro_batch_size=2: each batch in two halves
    "optim": ["adamw", "muon"],
    "sched": ["warmup_cosine", "wsd"],
    "precision": ["32", "bf16-mixed", "16-mixed"],  # 16-mixed: a GradScaler, on the CPU too
    "clip": [False, True],  # trainer.gradient_clip_val=0.5
    "workers": [0, 2],  # data.num_workers
}
# Left out: optim.adjust_lr_fn (match_rms_adamw here). Its other values scale Muon's update by a
# matrix's out/in ratio and read GPT-2's Conv1D weights, stored (in, out), the wrong way round:
# refused in one line for such a model (tests/unit/models/test_muon.py).
ROWS = pairwise(FACTORS)
# optim=muon: per layer GPT-2's c_attn, c_proj, c_fc, mlp.c_proj; Llama's q, k, v, o, gate, up,
# down. AdamW: the token (and GPT-2's position) embeddings, norms, GPT-2's biases.
MUON_MATRICES, ADAMW = {"gpt2": 8, "llama": 14}, {"gpt2": 20, "llama": 6}

# One SGD step on a global batch of 8 (one batch; 2 accumulated batches of 4; 2 micro-batches of
# 4): the same step, to float rounding, packed or padded, from a mixture
SPLITS = [("whole", 8, 1, "null"), ("accumulated", 4, 2, "null"), ("micro", 8, 1, 4)]
SEQ_LEN, BATCH, STEPS, STOP = 64, 4, 6, 3  # every epoch longer than STEPS optimizer steps
TRAIN, TEST = 192, 16  # documents per corpus: lines of 11 to 50 tokens, ~2 to a packed window


def _row_id(row: dict[str, Any]) -> str:
    words = {"accumulate": {1: "", 2: "acc2"}, "workers": {0: "", 2: "workers2"}}
    return "-".join(w for w in (words.get(k, {}).get(v, k if v is True else str(v))
                                for k, v in row.items() if v is not False) if w)


def test_the_rows_cover_every_pair_of_option_values() -> None:
    for a, b in itertools.combinations(FACTORS, 2):
        seen = {(row[a], row[b]) for row in ROWS}
        assert seen == set(itertools.product(FACTORS[a], FACTORS[b])), (a, b)
    assert len(ROWS) <= 12  # vs 3 * 2**9 = 1536 combinations


def _write_corpus(folder: Path, docs: list[str]) -> Path:
    """A saved ``DatasetDict``: the first :data:`TRAIN` of ``docs`` to train, the next
    :data:`TEST` to evaluate."""
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs[:TRAIN]}),
                          "test": datasets.Dataset.from_dict({"text": docs[TRAIN:TRAIN + TEST]})}
                         ).save_to_disk(str(folder))
    return folder


def _write_models(root: Path) -> dict[str, Path]:
    """Random-weight causal LMs with one tokenizer, their output layers tied to the token
    embeddings, :data:`SEQ_LEN` positions: ``GPT2LMHeadModel`` (``Conv1D`` layers, biases) and
    ``LlamaForCausalLM`` (``nn.Linear``, rotary positions, RMS norms), 2 layers 32 wide."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    tokenizer = write_tokenizer(root / "gpt2", vocab_size=384)
    tokenizer.save_pretrained(root / "llama")
    eos, vocab = tokenizer.eos_token_id, len(tokenizer)
    builds = {"gpt2": lambda: GPT2LMHeadModel(GPT2Config(
        vocab_size=vocab, n_positions=SEQ_LEN, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=eos, eos_token_id=eos)),
        "llama": lambda: LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ_LEN,
            tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos))}
    for name, build in builds.items():
        torch.manual_seed(0)
        build().save_pretrained(root / name)
    return {name: root / name for name in builds}


def _overrides(row: dict[str, Any], models: dict[str, Path], code: Path, prose: Path,
               run_dir: Path) -> list[str]:
    mix = (f"data.mix=[{{root: '{code}', weight: 3}}, {{root: '{prose}', weight: 1}}]"
           if row["mix"] else f"data.root={code}")
    return ["+exp=finetune_text", "model.task=causal_lm", "model.lora=null",
            "checkpoint.adapters_only=false", f"model.path={models[row['model']]}", mix,
            f"hydra.run.dir={run_dir}", f"data.pack={str(row['pack']).lower()}",
            f"data.batch_size={BATCH}", f"data.num_workers={row['workers']}",
            "data.eval_batch_size=8", f"data.seq_len={SEQ_LEN}",
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
    fit's re-run, in one process: the data folder and each fit's finished process."""
    root = tmp_path_factory.mktemp("text_combinations")
    models = _write_models(root / "models")
    code = _write_corpus(root / "code", code_lines())
    prose = _write_corpus(root / "prose", [" ".join(ln.split()[:6]) for ln in prose_lines()])
    runs: dict[str, list[str]] = {}
    for row in ROWS:
        name = _row_id(row)
        runs[f"{name}.whole"] = _overrides(row, models, code, prose, root / name / "whole")
        cut = _overrides(row, models, code, prose, root / name / "cut")
        runs[f"{name}.cut"] = [*cut, "+callbacks.stop._target_=tests.helpers.callbacks.SigtermAt",
                               f"+callbacks.stop.step={STOP}"]
        runs[f"{name}.resumed"] = cut
    for pack, (split, batch, accumulate, micro) in itertools.product((False, True), SPLITS):
        row = {**ROWS[0], "model": "llama", "pack": pack, "mix": True, "accumulate": accumulate}
        runs[f"step.{pack}.{split}"] = [*_overrides(  # the later of two values wins
            row, models, code, prose, root / "step" / f"{pack}.{split}"),
            f"data.batch_size={batch}", f"trainer.micro_batch_size={micro}", "trainer.max_steps=1",
            "trainer.eval_every_n_steps=1", "optim=sgd", "optim.lr=0.5", "optim.momentum=0",
            "optim.nesterov=false", "optim.weight_decay=0", "sched=constant",
            "~sched.warmup_steps"]
    return {"root": root, "models": models,
            "done": run_train_many(runs, root / "outputs", timeout=900)}


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
    assert a["config"]["data"]["num_workers"] == row["workers"]
    assert ("micro-batches of 2 samples" in log) == row["micro_batch"]
    groups = a["optimizer"]["param_groups"]
    if row["optim"] == "muon":  # the hidden matrices; the (tied) embeddings, norms, biases
        assert [(g["name"], len(g["params"])) for g in groups] == [
            ("default.muon", MUON_MATRICES[row["model"]]), ("default.adamw", ADAMW[row["model"]])]
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


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_a_step_is_the_token_mean_however_the_batch_is_split(pack: bool,
                                                             fits: dict[str, Any]) -> None:
    """The loss of a window is the mean over its real target tokens, whatever the split of the
    global batch (trainer.accumulate_grad_batches, trainer.micro_batch_size) and however many
    tokens each part holds. On Llama: no dropout, so the splits draw nothing at random."""
    from safetensors.torch import load_file

    for split, *_ in SPLITS:
        proc = fits["done"][f"step.{pack}.{split}"]
        assert proc.returncode == 0, (split, proc.stdout[-2000:] + proc.stderr[-3000:])
    steps = {split: _checkpoint(fits["root"] / "step" / f"{pack}.{split}")["model"]
             for split, *_ in SPLITS}
    start = load_file(fits["models"]["llama"] / "model.safetensors")
    moved = max((steps["whole"][k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-2, moved  # the step moved the weights
    for split in ("accumulated", "micro"):
        for key, value in steps["whole"].items():
            torch.testing.assert_close(steps[split][key], value, rtol=0, atol=1e-6,
                                       msg=f"{split} {key}")
