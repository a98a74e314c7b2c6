"""``+exp=finetune_text model.task=causal_lm`` end to end, for a tiny GPT-2 (``GPT2LMHeadModel``)
and a tiny Llama-style model, both with tied input and output embeddings and 64 positions
(below ``data.seq_len``'s 128), built and pretrained here with a byte-level BPE tokenizer trained
on this repository, saved with ``save_pretrained``, fine-tuned with LoRA on lines of Python's
sources: the validation loss falls below the base model's, SIGTERM + re-run ends bitwise,
``trainkit export`` writes a merged folder transformers loads with the tie kept, ``--format pt2``
and ``--adapters`` give the adapted model's logits, ``trainkit predict`` generates text, and the
run's output is trainkit's lines without the libraries' chatter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import REPO, assert_same_weights, last_checkpoint, offline_env
from tests.helpers.causal_lm import POSITIONS, write_code_lines, write_tiny_gpt2, write_tiny_llama

pytestmark = pytest.mark.slow

# the model, how to build it, and the layers LoRA adapts (GPT-2's fused attention; Llama's q, v)
MODELS = {"gpt2": (write_tiny_gpt2, "[c_attn]"), "llama": (write_tiny_llama, "[q_proj,v_proj]")}
STEPS = 32  # 2 epochs of 16 batches; the cut run is stopped in the second, at step 20
MARGIN = 0.03  # nats per token: the fine-tuned model's validation loss below the base model's


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_code_lines(tmp_path_factory.mktemp("causal_lm_data"))


def command(model: Path, data: Path, targets: str, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainkit.train", "+exp=finetune_text",
            "model.task=causal_lm", f"model.lora.target_modules={targets}",
            "model.lora.dropout=0", f"model.path={model}", f"data.root={data}",
            f"hydra.run.dir={run_dir}", "data.batch_size=16", "trainer.max_epochs=2",
            "trainer.precision=32", "trainer.device=cpu", "trainer.log_every_n_steps=4",
            "optim.lr=2e-2", "sched.warmup_steps=2", "checkpoint.every_n_steps=8",
            "checkpoint.monitor=val/loss", "checkpoint.mode=min", *extra]


def env(cache: Path) -> dict[str, str]:
    """Offline, with the libraries' progress bars as a user has them (on): trainkit turns
    them off; a datasets cache of the test's own, so the splits are generated here."""
    return offline_env(OMP_NUM_THREADS="1", HF_DATASETS_CACHE=str(cache), HF_HUB_OFFLINE="1",
                       TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")


@pytest.fixture(scope="module", params=list(MODELS))
def trained(request: pytest.FixtureRequest, data: Path,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The model's folder; an uninterrupted run, and one stopped by SIGTERM at step 20 then
    re-run; the first run's console output."""
    name = request.param
    write, targets = MODELS[name]
    root = tmp_path_factory.mktemp(f"causal_lm_{name}")
    model = write(root / "base")
    whole, cut = root / "whole", root / "cut"
    procs = [subprocess.Popen(command(model, data, targets, run_dir, *extra), cwd=REPO,
                              env=env(root / f"cache_{run_dir.name}"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for run_dir, extra in ((whole, ()), (cut, (
                 "+callbacks.stop._target_=tests.helpers.callbacks.SigtermAt",
                 "+callbacks.stop.step=20")))]
    outputs = []
    for proc, status in zip(procs, (0, 75)):
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == status, out[-3000:] + err[-3000:]
        outputs.append(out + err)
    assert last_checkpoint(cut)["global_step"] == 20
    proc = subprocess.run(command(model, data, targets, cut), cwd=REPO,
                          env=env(root / "cache_cut"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"name": name, "root": root, "model": model, "data": data, "whole": whole,
            "cut": cut, "output": outputs[0]}


def token_loss(model: torch.nn.Module, tokenizer: Any, texts: list[str]) -> float:
    """The mean next-token cross-entropy over ``texts`` (each cut to the model's positions)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(texts), 32):
            batch = tokenizer(texts[start:start + 32], truncation=True, max_length=POSITIONS,
                              padding=True, return_tensors="pt")
            labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)[:, 1:]
            logits = model(input_ids=batch["input_ids"],
                           attention_mask=batch["attention_mask"]).logits[:, :-1]
            total += torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), labels.flatten(), reduction="sum").item()
            count += int((labels != -100).sum())
    return total / count


def sample(tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Two texts of different lengths (the shorter padded), as model inputs."""
    batch = tokenizer(["def main(argv: list[str]) -> int:",
                       "for key, value in sorted(items.items()): print(key, value)"],
                      padding=True, return_tensors="pt")
    return batch["input_ids"], batch["attention_mask"]


def test_lora_fine_tuning_brings_the_validation_loss_below_the_base_models(
        trained: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import trainkit

    log = (trained["whole"] / "train.log").read_text()
    assert "training PeftModelForCausalLM" in log, log[:2000]  # PEFT's causal-LM task type
    tokenizer = AutoTokenizer.from_pretrained(trained["model"])
    texts = (trained["data"] / "test.txt").read_text().splitlines()
    base = token_loss(AutoModelForCausalLM.from_pretrained(trained["model"]).eval(), tokenizer,
                      texts)
    tuned = token_loss(trainkit.load_model(trained["whole"], "last"), tokenizer, texts)
    assert tuned < base - MARGIN, (base, tuned)
    summary = json.loads((trained["whole"] / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == STEPS, summary
    assert summary["metrics"]["val/loss"] < base - MARGIN, (base, summary["metrics"])


def test_sigterm_then_rerun_ends_bitwise_as_an_uninterrupted_run(trained: dict[str, Any]
                                                                  ) -> None:
    a, b = last_checkpoint(trained["whole"]), last_checkpoint(trained["cut"])
    assert a["global_step"] == b["global_step"] == STEPS
    assert a["model"] and all(".lora_" in k for k in a["model"]), list(a["model"])
    assert_same_weights(a["model"], b["model"])
    for x, y in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert_same_weights(x, y)
    assert "resumed from" in (trained["cut"] / "train.log").read_text()


def test_merged_export_loads_in_transformers_with_its_embeddings_tied(
        trained: dict[str, Any]) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import trainkit
    from trainkit.entry import export

    out = trained["root"] / "merged"
    assert export.main([str(trained["whole"]), "ckpt=last", "--out", str(out)]) == 0
    assert not any("lora" in key for key in load_file(out / "model.safetensors"))
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    embeddings, head = loaded.get_input_embeddings().weight, loaded.get_output_embeddings().weight
    assert head is embeddings  # the tie, as transformers makes it
    ids, mask = sample(AutoTokenizer.from_pretrained(out))  # the tokenizer written beside
    # in float64: what differs is then the export (the merge), not float32's rounding of
    # the merged weights' sums, which reaches 1e-5 in these logits
    with torch.no_grad():
        adapted = trainkit.load_model(trained["whole"], "last").double()(
            input_ids=ids, attention_mask=mask).logits
        for model in (loaded, trainkit.load_model(out)):
            logits = model.double()(input_ids=ids, attention_mask=mask).logits
            torch.testing.assert_close(logits, adapted, rtol=0, atol=1e-5)


def test_pt2_export_takes_texts_up_to_the_models_positions(trained: dict[str, Any]) -> None:
    """data.seq_len=128 over the model's 64 positions: cut to 64 at training (one line) and in
    the program's shapes."""
    from transformers import AutoTokenizer

    import trainkit
    from trainkit.entry import export

    log = (trained["whole"] / "train.log").read_text()
    assert (f"data.seq_len=128 is longer than the model takes ({POSITIONS} tokens): texts are "
            f"cut to {POSITIONS} tokens") in log, log[:2000]
    out = trained["root"] / "program"
    assert export.main([str(trained["whole"]), "ckpt=last", "--format", "pt2", "--out",
                        str(out)]) == 0
    assert json.loads((out / "model.json").read_text())["seq_len"] == POSITIONS
    program = torch.export.load(out / "model.pt2").module()
    tokenizer = AutoTokenizer.from_pretrained(out)
    longest = torch.randint(0, len(tokenizer), (1, POSITIONS))
    adapted = trainkit.load_model(trained["whole"], "last")
    for ids, mask in (sample(tokenizer), (longest, torch.ones_like(longest))):
        with torch.no_grad():
            expected = adapted(input_ids=ids, attention_mask=mask).logits
            # a float32 program of merged weights: their rounding, and the kernels' order on the
            # CPU's instruction set, move these logits by up to ~2e-5 (on an AVX2-only CPU:
            # 1.65e-5); a position cut wrongly moves them by far more
            torch.testing.assert_close(program(ids, mask), expected, rtol=1e-5, atol=5e-5)


def test_adapters_export_is_a_causal_lm_peft_folder(trained: dict[str, Any]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import trainkit
    from trainkit.entry import export

    out = trained["root"] / "adapters"
    assert export.main([str(trained["whole"]), "ckpt=last", "--adapters", "--out",
                        str(out)]) == 0
    assert json.loads((out / "adapter_config.json").read_text())["task_type"] == "CAUSAL_LM"
    base = AutoModelForCausalLM.from_pretrained(trained["model"])
    peft = PeftModel.from_pretrained(base, out).eval()
    assert type(peft).__name__ == "PeftModelForCausalLM"
    ids, mask = sample(AutoTokenizer.from_pretrained(trained["model"]))
    with torch.no_grad():
        expected = trainkit.load_model(trained["whole"], "last")(input_ids=ids,
                                                                 attention_mask=mask).logits
        torch.testing.assert_close(peft(input_ids=ids, attention_mask=mask).logits, expected,
                                   rtol=0, atol=1e-5)


def test_predict_generates_text(trained: dict[str, Any]) -> None:
    from trainkit.entry import predict

    prompts = trained["root"] / "prompts.txt"
    prompts.write_text("def __init__(self, name):\nfor index, item in enumerate(\n")
    out = trained["root"] / "generated.jsonl"
    assert predict.main([str(trained["whole"]), f"inputs={prompts}", f"out={out}",
                         "max_new_tokens=12"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["input"] for row in rows] == prompts.read_text().splitlines()
    # a continuation for each prompt (a tiny model's may be spaces), and words among them
    assert all(isinstance(row["text"], str) and row["text"] for row in rows), rows
    assert any(row["text"].strip() for row in rows), rows


def test_the_runs_output_is_trainkits_lines_without_the_libraries_chatter(
        trained: dict[str, Any]) -> None:
    output = trained["output"]
    for noise in ("\x1b[", "LOAD REPORT", "Generating train split", "Loading weights", "it/s]",
                  "Tensor.item() cannot be called", "loss_type=None", "fan_in_fan_out",
                  "Warning"):
        assert noise not in output, (noise, output[:3000])
    flops = [line for line in output.splitlines() if "FLOPs not counted" in line]
    assert len(flops) == 1 and flops[0].endswith(
        "FLOPs not counted, so no throughput/tflops or MFU: the model's forward reads values of "
        "its inputs (Tensor.item()), and they are counted on shapes alone"), flops
