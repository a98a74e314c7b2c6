"""After training: ``trainkit evaluate``, ``predict`` and ``export`` of a finished run, and
``trainkit.load_model``, on one tiny MNIST run with EMA and a monitored metric (generated files).

The exports are loaded in a Python that cannot import trainkit (``-I -S``: no site hooks, so
not the editable install's; the site-packages folder on ``sys.path`` for torch alone).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, error_report, offline_env, run_module, run_train, tiny_run
from tests.image_files import make_folder
from trainkit import load_model
from trainkit.checkpoint.export import read_inputs
from trainkit.core.runtime import Runtime
from trainkit.data.loader.memory import InMemoryLoader
from trainkit.data.sources.tensors import TensorData, load_mnist
from trainkit.entry import cli
from trainkit.entry.build import build_data, data_inputs, rebuild, run_classes
from trainkit.entry.evaluate import evaluate_run
from trainkit.entry.export import export_run
from trainkit.entry.predict import image_source

pytestmark = pytest.mark.slow
SITE = sysconfig.get_paths()["purelib"]
# Run by `python -I -S -c`: torch (and hydra, safetensors) importable, trainkit not.
WITHOUT_TRAINKIT = """
import importlib.util, sys
sys.path.append(sys.argv[1])
assert importlib.util.find_spec("trainkit") is None, "trainkit is importable here"
import torch
"""
LOAD_PT2 = WITHOUT_TRAINKIT + """
model = torch.export.load(sys.argv[2] + "/model.pt2").module()
torch.save(model(torch.load(sys.argv[3])), sys.argv[4])
"""
LOAD_SAFETENSORS = WITHOUT_TRAINKIT + """
import json
from hydra.utils import instantiate
from safetensors.torch import load_file
info = json.load(open(sys.argv[2] + "/model.json"))
model = instantiate(info["model"])
model.load_state_dict(load_file(sys.argv[2] + "/" + info["file"]))
with torch.no_grad():
    torch.save(model.eval()(torch.load(sys.argv[3])), sys.argv[4])
"""


def run_without_trainkit(code: str, export: Path, batch: torch.Tensor, tmp: Path
                         ) -> torch.Tensor:
    """The outputs a process without trainkit computes with ``code`` on ``batch``."""
    torch.save(batch, tmp / "batch.pt")
    result = subprocess.run([sys.executable, "-I", "-S", "-c", code, SITE, str(export),
                             str(tmp / "batch.pt"), str(tmp / "out.pt")],
                            cwd=tmp, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(tmp / "out.pt")


def trainkit_command(*args: str) -> subprocess.CompletedProcess[str]:
    """``trainkit <args>`` as the console command runs it (its module, in a process)."""
    return run_module("trainkit.entry.cli", *args)


def normalised(images: torch.Tensor, split: TensorData) -> torch.Tensor:
    """``images`` as the run's loader hands them to the model (``split``'s mean/std)."""
    data = TensorData(images, torch.zeros(len(images), dtype=torch.int64), split.mean,
                      split.std, split.num_classes)
    return next(iter(InMemoryLoader(data, len(images), shuffle=False)))[0]


def write_pngs(images: torch.Tensor, folder: Path) -> Path:
    """``images`` (uint8 ``[N, 1, H, W]``) as ``digit_<i>.png`` files in a new ``folder``."""
    from PIL import Image

    folder.mkdir()
    for i, image in enumerate(images):
        Image.fromarray(image[0].numpy(), mode="L").save(folder / f"digit_{i:02d}.png")
    return folder


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, mnist_root: Path) -> Path:
    """12 steps evaluated every 4 with an EMA, checkpoints every 4. ``best`` is by the HIGHEST
    val/loss, so it is an early step and not the last: a mix-up of the two shows."""
    run_dir = tmp_path_factory.mktemp("run")
    result = run_train(*tiny_run(run_dir, mnist_root, "model.widths=[8,16,32]",
                                 "trainer.max_steps=12", "trainer.eval_every_n_steps=4",
                                 "trainer.ema_decay=0.9", "checkpoint.every_n_steps=4",
                                 "checkpoint.monitor=val/loss", "checkpoint.mode=max"))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def recorded(run_dir: Path) -> dict[int, dict[str, float]]:
    """The evaluations metrics.jsonl recorded, by step."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row.pop("step"): row for row in rows if "val/loss" in row}


@pytest.fixture(scope="module")
def mnist_test(mnist_root: Path) -> TensorData:
    return load_mnist(mnist_root, train=False, verify=False, download=False)


@pytest.fixture(scope="module")
def images(mnist_test: TensorData) -> torch.Tensor:
    return mnist_test.images[:50]


def test_evaluate_best_reproduces_the_value_the_run_recorded_bitwise(run: Path) -> None:
    result = trainkit_command("evaluate", str(run), "ckpt=best")
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((run / "eval_best.json").read_text())
    evaluations = recorded(run)
    best_step = max(evaluations, key=lambda step: evaluations[step]["val/loss"])
    assert best_step < 12 and record["step"] == best_step
    assert record["weights"] == "ema"
    assert record["metrics"] == evaluations[best_step]  # bitwise: the floats as written
    assert result.stdout.strip().splitlines()[-1].startswith(f"best (step {best_step}, ema ")


def test_the_readmes_evaluate_line_takes_best_where_kept_else_last(run: Path,
                                                                  tmp_path: Path) -> None:
    """``trainkit evaluate runs/a`` as the README gives it (no ``ckpt=``): the best checkpoint
    where the run kept one; the last where it kept none (the README's ``+exp=mnist`` run
    monitors nothing)."""
    kept, none = tmp_path / "kept", tmp_path / "none"
    for copy in (kept, none):
        shutil.copytree(run, copy, ignore=shutil.ignore_patterns("eval_*.json"))
    (none / "checkpoints" / "best.pt").unlink()
    for copy in (kept, none):
        cli.main(["evaluate", str(copy)])
    best = json.loads((kept / "eval_best.json").read_text())
    assert best["step"] == json.loads((run / "summary.json").read_text())["best"]["step"]
    last = json.loads((none / "eval_last.json").read_text())
    assert last["metrics"] == json.loads((run / "summary.json").read_text())["metrics"]
    assert not (none / "eval_best.json").exists()


def test_summary_records_the_best_checkpoint_that_evaluate_best_reproduces(run: Path) -> None:
    best = json.loads((run / "summary.json").read_text())["best"]
    evaluated = evaluate_run(run, "best")
    assert best == {"metric": "val/loss", "value": evaluated["metrics"]["val/loss"],
                    "step": evaluated["step"], "path": str(run / "checkpoints" / "best.pt")}
    assert best["step"] < 12  # by the highest val/loss: not the last step


def test_the_console_command_imports_the_current_folders_modules(run: Path,
                                                                  tmp_path: Path) -> None:
    """``trainkit evaluate`` (the installed console script, whose own folder is first on its
    sys.path) finds a module of the folder it runs in, as ``python -m trainkit.train`` does."""
    script = Path(sys.executable).parent / "trainkit"
    assert script.is_file(), "the console script is installed with the package (make install)"
    shutil.copytree(run, tmp_path / "run")
    (tmp_path / "my_net.py").write_text("from trainkit.models import MnistNet as Net\n")
    result = subprocess.run([str(script), "evaluate", "run", "ckpt=last",
                             "model._target_=my_net.Net"], cwd=tmp_path,
                            env=offline_env(PYTHONPATH=str(REPO)), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads((tmp_path / "run" / "eval_last.json").read_text())
    assert record["metrics"] == json.loads((run / "summary.json").read_text())["metrics"]


def test_evaluate_last_and_step_n_equal_the_summary_and_their_evaluations(run: Path) -> None:
    summary = json.loads((run / "summary.json").read_text())
    assert evaluate_run(run, "last")["metrics"] == summary["metrics"]
    assert evaluate_run(run, "step_8")["metrics"] == recorded(run)[8]
    raw = evaluate_run(run, "last", weights="raw")
    assert raw["weights"] == "raw" and raw["metrics"] != summary["metrics"]
    assert (run / "eval_last_raw.json").is_file()


def test_export_pt2_runs_with_torch_alone_and_gives_trainkits_logits(
        run: Path, images: torch.Tensor, mnist_test: TensorData, tmp_path: Path) -> None:
    result = trainkit_command("export", str(run), "--format", "pt2", "--out",
                              str(tmp_path / "pt2"))
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = run_without_trainkit(LOAD_PT2, tmp_path / "pt2", images, tmp_path)
    with torch.no_grad():  # trainkit's model of the best checkpoint, on the loaders' inputs
        ours = load_model(run, ckpt="best")(normalised(images, mnist_test))
    assert torch.equal(theirs, ours)
    info = json.loads((tmp_path / "pt2" / "model.json").read_text())
    assert info["model"]["_target_"] == "trainkit.models.MnistNet"
    assert info["classes"] == [str(i) for i in range(10)] and info["image_size"] == [1, 28, 28]
    assert info["mean"] == [0.1307] and info["weights"] == "ema"
    assert info["manifest"]["config_sha256"] and info["manifest"]["torch"]
    rebuilt = rebuild(run, "best", "auto", [])  # the record: what the data gives, read again
    assert read_inputs(run) == data_inputs(rebuilt.cfg, rebuilt.settings, None)
    assert not read_inputs(run).fused and read_inputs(run).image_size == (1, 28, 28)


def test_exported_weights_are_the_emas_unless_raw_is_asked(run: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    best = torch.load(run / "checkpoints" / "best.pt", map_location="cpu", weights_only=True)
    export_run([str(run)], out=tmp_path / "ema")
    export_run([str(run), "ckpt=best"], weights="raw", dtype="bf16", out=tmp_path / "raw")
    ema, raw = load_file(tmp_path / "ema" / "model.safetensors"), load_file(
        tmp_path / "raw" / "model.safetensors")
    for name, tensor in best["ema"]["weights"].items():
        assert torch.equal(ema[name], tensor), name
        if tensor.is_floating_point():
            assert torch.equal(raw[name], best["model"][name].to(torch.bfloat16)), name
    assert not all(torch.equal(ema[n], best["model"][n]) for n in ema)


def test_predict_over_a_folder_of_50_images_writes_50_rows_in_order(
        run: Path, images: torch.Tensor, mnist_test: TensorData, tmp_path: Path) -> None:
    folder = write_pngs(images, tmp_path / "images")
    out = tmp_path / "predictions.jsonl"
    assert cli.main(["predict", str(run), f"inputs={folder}", f"out={out}", "topk=3"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    with torch.no_grad():
        logits = load_model(run)(normalised(images, mnist_test))
    assert [row["input"] for row in rows] == [str(folder / f"digit_{i:02d}.png")
                                              for i in range(50)]
    assert [row["classes"][0] for row in rows] == [str(i) for i in logits.argmax(1).tolist()]
    assert all(len(row["probs"]) == 3 and row["probs"] == sorted(row["probs"], reverse=True)
               for row in rows)
    raw = tmp_path / "outputs.pt"
    assert cli.main(["predict", str(run), "inputs=test", f"out={raw}"]) == 0
    saved = torch.load(raw, weights_only=True)
    assert saved["inputs"][:50] == list(range(50)) and torch.equal(saved["outputs"][:50], logits)


def test_predict_skips_an_unreadable_input_with_skip_corrupt_as_training_does(
        run: Path, images: torch.Tensor, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Without data.skip_corrupt one line names the file; with it the file gets no row and is
    said and counted (the override used to change nothing)."""
    folder = write_pngs(images[:4], tmp_path / "images")
    bad = folder / "digit_01.png"
    bad.write_bytes(bad.read_bytes()[:40])  # a copy that broke off
    out = tmp_path / "rows.jsonl"
    with pytest.raises(SystemExit) as stop:
        cli.main(["predict", str(run), f"inputs={folder}", f"out={out}"])
    assert stop.value.code == 2 and not out.exists()
    details, last = error_report(capsys.readouterr().err)
    # the line ends with the file; a long line is cut in the middle, its whole message then a
    # detail line above it
    assert last.endswith(str(bad)), last
    assert f"set data.skip_corrupt=true to skip such files: {bad}" in " ".join([*details, last])
    assert cli.main(["predict", str(run), f"inputs={folder}", f"out={out}",
                     "data.skip_corrupt=true"]) == 0
    rows = [json.loads(line)["input"] for line in out.read_text().splitlines()]
    assert rows == [str(folder / f"digit_{i:02d}.png") for i in (0, 2, 3)]
    said = capsys.readouterr()
    assert f"skipped unreadable input {bad} (data.skip_corrupt=true; 1 so far)" in said.err
    assert said.out.strip() == (f"wrote 3 rows to {out} (1 unreadable inputs skipped: "
                                "data.skip_corrupt=true)")


def test_bad_input_is_one_line_exit_2_and_nothing_overwritten(
        run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def fails(*args: str) -> str:
        with pytest.raises(SystemExit) as stop:
            cli.main(list(args))
        assert stop.value.code == 2
        return error_report(capsys.readouterr().err)[1]

    assert "has no checkpoints" in fails("evaluate", str(tmp_path))
    no_best = tmp_path / "no_best"
    shutil.copytree(run / "checkpoints", no_best / "checkpoints")
    (no_best / "checkpoints" / "best.pt").unlink()
    assert "kept no best checkpoint" in fails("evaluate", str(no_best), "ckpt=best")
    assert "model._target_=nowhere.Net, no longer builds here" in fails(
        "evaluate", str(run), "model._target_=nowhere.Net")
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "mine.txt").write_text("mine")
    assert f"export folder {kept} exists" in fails("export", str(run), "--out", str(kept))
    out = tmp_path / "rows.jsonl"
    out.write_text("mine")
    assert "exists" in fails("predict", str(run), "inputs=test", f"out={out}")
    assert [p.name for p in kept.iterdir()] == ["mine.txt"] and out.read_text() == "mine"
    assert not list(tmp_path.glob(".*tmp"))


def test_image_folder_resnet_run_predicts_and_exports_what_its_own_loader_evaluates(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``+exp=folder`` (torchvision's ResNet-18, image files, EMA, best by val/acc): predict
    over its val/ folder gives, file for file, the outputs of the run's own validation loader
    (its resize, centre crop and normalisation), with its class names; so does its pt2 export,
    and its safetensors export rebuilt by ``hydra.utils.instantiate`` on model.json in a Python
    without trainkit (a model whose class the user has)."""
    folder = make_folder(tmp_path / "images")
    run_dir = tmp_path / "run"
    result = run_train("+exp=folder", f"hydra.run.dir={run_dir}", f"data.root={folder}",
                       "data.image_size=32", "data.batch_size=8", "data.eval_batch_size=16",
                       "data.num_workers=0", "trainer.max_steps=2", "trainer.precision=32")
    assert result.returncode == 0, result.stderr[-3000:]
    raw, rows = tmp_path / "val.pt", tmp_path / "val.jsonl"
    assert cli.main(["predict", str(run_dir), f"inputs={folder / 'val'}", f"out={raw}"]) == 0
    assert cli.main(["predict", str(run_dir), f"inputs={folder / 'val'}", f"out={rows}"]) == 0
    outputs = torch.load(raw, weights_only=True)["outputs"]
    split = tmp_path / "test.pt"  # the run's own validation split: the same files, in order
    assert cli.main(["predict", str(run_dir), "inputs=test", f"out={split}"]) == 0
    by_split, by_file = torch.load(split, weights_only=True), torch.load(raw, weights_only=True)
    assert by_split["inputs"] == by_file["inputs"]
    assert torch.equal(by_split["outputs"], outputs)
    with pytest.raises(SystemExit) as stop:  # a folder with no val/, none held out: one line
        cli.main(["predict", str(run_dir), "inputs=test", f"data.root={folder / 'train'}",
                  "data.val_fraction=0", f"out={tmp_path / 'none.pt'}"])
    assert stop.value.code == 2
    assert "has no val/ and the run held none out" in error_report(capsys.readouterr().err)[1]
    run = rebuild(run_dir, "best", "auto", [])
    _, val_data, _ = build_data(run.cfg, run.settings, Runtime.from_env("cpu"))
    batch = torch.cat([x.contiguous() for x, _ in val_data])  # as predict's: pixels compared
    with torch.no_grad():
        theirs = run.model(batch)
    assert torch.equal(outputs, theirs)
    names = ["class_0", "class_1", "class_2"]
    first = [json.loads(line)["classes"][0] for line in rows.read_text().splitlines()]
    assert first == [names[i] for i in theirs.argmax(1).tolist()]
    out = export_run([str(run_dir)], fmt="pt2", out=tmp_path / "export")
    info = json.loads((out / "model.json").read_text())
    assert info["classes"] == names and info["image_size"] == [3, 32, 32]
    assert info["eval_transform"] == {"resize_short_side": 36, "center_crop": 32}
    # a data key given to export wins over what the run recorded (never silently ignored)
    larger = export_run([str(run_dir), "data.image_size=48"], fmt="pt2", out=tmp_path / "at48")
    assert json.loads((larger / "model.json").read_text())["image_size"] == [3, 48, 48]
    _, read = image_source(run)
    files = sorted(p for p in (folder / "val").rglob("*") if p.is_file())
    with torch.no_grad():
        assert torch.equal(load_model(out)(torch.stack([read(f) for f in files])), outputs)
    result = trainkit_command("export", str(run_dir), "--format", "safetensors", "--out",
                              str(tmp_path / "model_export"))
    assert result.returncode == 0, result.stderr[-3000:]
    info = json.loads((tmp_path / "model_export" / "model.json").read_text())
    assert info["model"]["_target_"] == "torchvision.models.resnet18"
    assert torch.equal(run_without_trainkit(LOAD_SAFETENSORS, tmp_path / "model_export", batch,
                                            tmp_path), outputs)


@pytest.mark.parametrize("dataset", [
    ("Pictures",), ("hf_split", "+dataset.cache_dir={tmp}/hf_cache")], ids=["torch", "hf"])
def test_own_dataset_run_predicts_its_splits_and_files_and_exports_as_its_loader_evaluates(
        tmp_path: Path, dataset: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """A run on a dataset of the user's, a torch ``Dataset`` (PIL images of mixed sizes) or a
    Hugging Face ``datasets.Dataset`` (its image column's file bytes), from a module of the
    user's folder: ``inputs=test`` (the dataset's own samples), its files and its export all
    give the outputs of the run's own validation loader, with the dataset's class names. Predict
    over files and export, run where that module is not importable, use what the run recorded
    (``inputs.json``)."""
    if dataset[0] == "hf_split":
        pytest.importorskip("datasets")
    folder = make_folder(tmp_path / "images", per_class=4, val_per_class=2)
    project, module = tmp_path / "project", f"my_{dataset[0].lower()}_data"
    project.mkdir()  # the user's own module, importable from their project's folder only
    (project / f"{module}.py").write_text(f"from tests.image_files import {dataset[0]}\n")
    run_dir = tmp_path / "run"
    result = run_train("data=image_folder", f"data.root={folder}", f"hydra.run.dir={run_dir}",
                       "data.name=own", f"+dataset._target_={module}.{dataset[0]}",
                       *(o.format(tmp=tmp_path) for o in dataset[1:]),
                       "model._target_=tests.image_files.TinyNet", "~model.widths",
                       "data.image_size=24", "data.batch_size=4", "data.eval_batch_size=8",
                       "data.num_workers=0", "trainer.max_steps=2", "trainer.precision=32",
                       env=offline_env(PYTHONPATH=os.pathsep.join([str(project), str(REPO)])))
    assert result.returncode == 0, result.stderr[-3000:]
    export = trainkit_command("export", str(run_dir), "--format", "pt2", "--out",
                              str(tmp_path / "export"))  # its module not importable here
    assert export.returncode == 0, export.stderr[-3000:]
    by_split, by_file = tmp_path / "test.pt", tmp_path / "files.pt"
    assert cli.main(["predict", str(run_dir), f"inputs={folder / 'val'}", f"out={by_file}"]) == 0
    monkeypatch.syspath_prepend(str(project))  # the run's data, for the rest
    run = rebuild(run_dir, "last", "auto", [])
    assert read_inputs(run_dir) == data_inputs(run.cfg, run.settings, run_classes(run))
    _, val_data, _ = build_data(run.cfg, run.settings, Runtime.from_env("cpu"))
    with torch.no_grad():
        theirs = run.model(torch.cat([x for x, _ in val_data]))
    assert cli.main(["predict", str(run_dir), "inputs=test", f"out={by_split}"]) == 0
    split, files = torch.load(by_split), torch.load(by_file)
    assert split["inputs"] == list(range(6)) and len(files["inputs"]) == 6
    assert torch.equal(split["outputs"], theirs) and torch.equal(files["outputs"], theirs)
    out = tmp_path / "export"
    assert json.loads((out / "model.json").read_text())["classes"] == [
        "class_0", "class_1", "class_2"]
    _, read = image_source(run)
    with torch.no_grad():
        exported = load_model(out)(torch.stack([read(Path(f)) for f in files["inputs"]]))
    assert torch.equal(exported, theirs)


def largest_logit(outputs: torch.Tensor, inputs: list) -> list[dict]:
    """A user's ``predict=`` function: its own rows from a batch's outputs."""
    return [{"index": name, "largest": float(row.max())} for name, row in zip(inputs, outputs)]


def test_predict_with_the_users_own_function(run: Path, mnist_test: TensorData,
                                             tmp_path: Path) -> None:
    out = tmp_path / "own.jsonl"
    function = f"{__name__}.largest_logit"
    assert cli.main(["predict", str(run), "inputs=test", f"out={out}", f"predict={function}",
                     "data.eval_batch_size=100"]) == 0  # three batches, rows still in order
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["index"] for row in rows] == list(range(256))
    with torch.no_grad():
        largest = load_model(run)(normalised(mnist_test.images, mnist_test)).amax(1)
    assert [row["largest"] for row in rows] == pytest.approx(largest.tolist(), rel=1e-5)
