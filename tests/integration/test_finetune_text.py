"""+exp=finetune_text for real: a tiny BERT sequence classifier (built from a config, pretrained
here, saved with save_pretrained, its WordPiece tokenizer trained on Python's sources) fine-tuned
with LoRA through ``python -m trainkit.train`` on a CSV of code and prose lines. The loss falls,
only the adapters and the new head change, SIGTERM + re-run ends bitwise where an uninterrupted
run does (checkpoints of the adapters alone), export merges the adapters (safetensors and pt2)
and its logits equal the adapted model's; evaluate and predict work on the run; bad input is one
line, exit 2, nothing written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, assert_same_weights, error_report, last_checkpoint, offline_env
from tests.helpers.hf_text import write_code_or_prose, write_tiny_bert

pytestmark = pytest.mark.slow

# offline, and without the libraries' progress bars (stderr then ends in trainkit's lines only)
HF_QUIET = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
STEPS = 24  # 2 epochs of 12 batches; the cut run is stopped in the second, at step 16


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("finetune_text")
    cache = root / "hf_cache"  # the datasets library's arrow files: in the test's folder
    return {"model": write_tiny_bert(root / "bert"), "data": write_code_or_prose(root / "data"),
            "root": root, "cache": cache}


def command(assets: dict[str, Path], run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainkit.train", "+exp=finetune_text",
            f"model.path={assets['model']}", f"data.root={assets['data']}",
            f"hydra.run.dir={run_dir}", "data.batch_size=16", "trainer.max_epochs=2",
            "trainer.precision=32", "trainer.device=cpu", "trainer.log_every_n_steps=2",
            "optim.lr=1e-2", "sched.warmup_steps=2", "checkpoint.every_n_steps=8", *extra]


def env(assets: dict[str, Path]) -> dict[str, str]:
    return offline_env(OMP_NUM_THREADS="1", HF_DATASETS_CACHE=str(assets["cache"]),
                       **HF_QUIET)


def run(assets: dict[str, Path], run_dir: Path, *extra: str, status: int = 0
        ) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(command(assets, run_dir, *extra), cwd=REPO, env=env(assets),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == status, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def runs(assets: dict[str, Path]) -> dict[str, Path]:
    """An uninterrupted run, and one stopped by SIGTERM at step 16 (mid-epoch) then re-run."""
    whole, cut = assets["root"] / "whole", assets["root"] / "cut"
    procs = [subprocess.Popen(command(assets, run_dir, *extra), cwd=REPO, env=env(assets),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for run_dir, extra in ((whole, ()), (cut, (
                 "+callbacks.stop._target_=tests.helpers.callbacks.SigtermAt",
                 "+callbacks.stop.step=16")))]
    for proc, status in zip(procs, (0, 75)):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == status, out[-3000:] + err[-3000:]
    assert last_checkpoint(cut)["global_step"] == 16
    run(assets, cut)
    return {"whole": whole, "cut": cut}


def test_lora_fine_tuning_learns_and_changes_only_the_adapters_and_head(
        assets: dict[str, Path], runs: dict[str, Path]) -> None:
    from safetensors.torch import load_file

    import trainkit

    lines = [json.loads(line) for line in (runs["whole"] / "metrics.jsonl").read_text()
             .splitlines()]
    losses = [line["train/loss"] for line in lines if "train/loss" in line]
    assert len(losses) == STEPS // 2 and max(losses[-3:]) < 0.75 * min(losses[:2]), losses
    summary = json.loads((runs["whole"] / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["metrics"]["val/acc"] > 0.8, summary

    saved = last_checkpoint(runs["whole"])["model"]  # the adapters and the head alone
    assert saved and all(".lora_" in k or ".modules_to_save." in k for k in saved), list(saved)
    assert {k.split(".")[-3] for k in saved if ".lora_" in k} == {"lora_A", "lora_B"}
    base = load_file(assets["model"] / "model.safetensors")
    tuned = trainkit.load_model(runs["whole"], "last").state_dict()
    changed = []
    for key, value in tuned.items():
        name = (key.removeprefix("base_model.model.").replace(".base_layer.", ".")
                .replace(".original_module.", "."))
        if ".lora_" in key or ".modules_to_save." in key:
            changed.append(key)
        else:  # the frozen base: the folder's tensors, bitwise
            assert torch.equal(value, base[name]), key
    assert sorted(changed) == sorted(saved)
    for key in saved:  # each adapter and the head moved from where it started
        if ".lora_B." in key:
            assert saved[key].abs().max() > 0, key  # PEFT starts B at zero
        if ".modules_to_save." in key:
            start = base[key.removeprefix("base_model.model.").replace(
                ".modules_to_save.default.", ".")]
            assert not torch.equal(saved[key], start), key


def test_sigterm_then_rerun_ends_bitwise_as_an_uninterrupted_run(runs: dict[str, Path]
                                                                  ) -> None:
    a, b = last_checkpoint(runs["whole"]), last_checkpoint(runs["cut"])
    assert a["global_step"] == b["global_step"] == STEPS
    assert_same_weights(a["model"], b["model"])
    for x, y in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert_same_weights(x, y)
    assert "resumed from" in (runs["cut"] / "train.log").read_text()


def test_export_merges_the_adapters_and_gives_the_adapted_models_logits(
        assets: dict[str, Path], runs: dict[str, Path]) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    import trainkit
    from trainkit.entry.export import export_run

    run_dir = runs["whole"]
    folders = {fmt: export_run([str(run_dir), "ckpt=last"], fmt=fmt,
                               out=assets["root"] / f"export_{fmt}")
               for fmt in ("safetensors", "pt2")}
    adapters = export_run([str(run_dir), "ckpt=last"], adapters=True,
                          out=assets["root"] / "adapters")
    tokenizer = AutoTokenizer.from_pretrained(folders["safetensors"])  # written beside
    batch = tokenizer(["def main(argv: list[str]) -> int:",
                       "Return the number of items in the container, or zero."],
                      padding=True, return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        adapted = trainkit.load_model(run_dir, "last")(input_ids=ids, attention_mask=mask).logits
        merged = trainkit.load_model(folders["safetensors"])
        assert not any("lora" in k for k in merged.state_dict())  # merged: BERT's own keys
        outputs = {
            "merged": merged(input_ids=ids, attention_mask=mask).logits,
            "transformers": AutoModelForSequenceClassification.from_pretrained(
                folders["safetensors"])(input_ids=ids, attention_mask=mask).logits,
            "pt2": torch.export.load(folders["pt2"] / "model.pt2").module()(ids, mask),
            "peft": _peft_model(assets["model"], adapters)(input_ids=ids,
                                                           attention_mask=mask).logits,
        }
    for name, logits in outputs.items():
        torch.testing.assert_close(logits, adapted, rtol=0, atol=1e-6, msg=name)
    info = json.loads((folders["pt2"] / "model.json").read_text())
    assert info["classes"] == ["code", "prose"] and "lora" not in info["model"]
    config = AutoModelForSequenceClassification.from_pretrained(folders["safetensors"]).config
    assert config.id2label == {0: "code", 1: "prose"}  # what pipelines show, not LABEL_0
    assert config.label2id == {"code": 0, "prose": 1}


def _peft_model(base: Path, adapters: Path) -> torch.nn.Module:
    """The base folder with the exported adapters, as a PEFT user loads them."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(base)
    return PeftModel.from_pretrained(model, adapters).eval()


def test_evaluate_and_predict_on_the_run(assets: dict[str, Path], runs: dict[str, Path],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from trainkit.entry import evaluate, predict

    run_dir = runs["whole"]
    assert evaluate.main([str(run_dir), "ckpt=last"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    result = json.loads((run_dir / "eval_last.json").read_text())
    assert result["metrics"]["val/acc"] == summary["metrics"]["val/acc"]
    texts = assets["root"] / "texts.txt"
    texts.write_text("for key, value in sorted(items.items()):\n"
                     "Return a new list with the items of the iterable in ascending order.\n")
    out = assets["root"] / "predicted.jsonl"
    assert predict.main([str(run_dir), f"inputs={texts}", f"out={out}", "topk=1"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["classes"] for row in rows] == [["code"], ["prose"]], rows


def test_bad_input_is_one_line_exit_2_and_nothing_written(assets: dict[str, Path]) -> None:
    no_tokenizer = assets["root"] / "weights_only"  # a model folder without its tokenizer
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(assets["model"] / name, no_tokenizer)
    cases = {("model.lora.target_modules=[query,qkv_proj]",):
             "model.lora.target_modules: qkv_proj names no module of BertForSequenceClassific",
             (f"data.tokenizer={no_tokenizer}",): "weights_only holds no tokenizer: save one"}
    procs = [subprocess.Popen(command(assets, assets["root"] / f"bad{i}", *extra), cwd=REPO,
                              env=env(assets), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i, extra in enumerate(cases)]
    for i, (proc, words) in enumerate(zip(procs, cases.values())):
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, err[-2000:]
        assert words in error_report(err)[1], err[-2000:]
        assert not (assets["root"] / f"bad{i}").exists()
