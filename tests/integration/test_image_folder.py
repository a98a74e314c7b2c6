"""``python -m trainkit.train data=image_folder``: a folder of mixed files trains, is preempted
mid-epoch and resumes bitwise; runs under torchrun; bad data stops it in one line; your own
torch and Hugging Face datasets train through ``dataset._target_`` and resume exactly."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    REPO,
    assert_same_weights,
    error_report,
    last_checkpoint,
    offline_env,
    run_train,
    start_in_own_group,
)
from tests.image_files import make_folder, truncate
from trainkit.core.signals import EXIT_PREEMPTED

pytestmark = pytest.mark.slow


def folder_run(run_dir: Path, root: Path, *extra: str) -> list[str]:
    """Overrides for a few steps of a tiny conv net on a generated folder, 2 loader workers."""
    return ["data=image_folder", f"data.root={root}", f"hydra.run.dir={run_dir}",
            "model._target_=tests.image_files.TinyNet", "~model.widths",
            "data.image_size=24", "data.batch_size=4", "data.eval_batch_size=8",
            "data.num_workers=2", "trainer.precision=32", "trainer.log_every_n_steps=1",
            "trainer.max_epochs=2", "sched=constant", *extra]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 classes x 6 training files of every kind (5 batches of 4 an epoch), one truncated."""
    root = make_folder(tmp_path_factory.mktemp("images"), per_class=6, val_per_class=2)
    truncate(sorted((root / "train" / "class_1").glob("*.jpg"))[0])
    return root


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, folder: Path) -> Path:
    """The uninterrupted 2-epoch run over ``folder``, skipping its truncated file. Shared: the
    SIGTERM test's reference and the truncated-file test's finished run (which uses a copy)."""
    run_dir = tmp_path_factory.mktemp("straight")
    result = run_train(*folder_run(run_dir, folder, "data.skip_corrupt=true"))
    assert result.returncode == 0, result.stderr[-2000:]
    return run_dir


def test_sigterm_mid_epoch_then_resume_is_bitwise_an_uninterrupted_run(
        tmp_path: Path, folder: Path, straight: Path) -> None:
    common = ("data.skip_corrupt=true",)
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["data/skipped_files"] == 1 and summary["global_step"] == 10
    assert "skipped unreadable file" in (straight / "train.log").read_text()
    assert json.loads((straight / "classes.json").read_text()) == {
        "classes": ["class_0", "class_1", "class_2"]}

    run_dir, marker = tmp_path / "preempted", tmp_path / "at-step-3"
    overrides = folder_run(run_dir, folder, *common, "+callbacks.pause._target_="
                           "tests.helpers.pause.PauseAt", "+callbacks.pause.step=3",
                           f"+callbacks.pause.marker={marker}")
    proc = start_in_own_group([sys.executable, "-m", "trainkit.train", *overrides],
                              tmp_path / "out.txt")
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():  # step 3 of 5 done; the run waits for the signal
            assert proc.poll() is None, (tmp_path / "out.txt").read_text()[-2000:]
            assert time.monotonic() < deadline, "step 3 never came"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)  # the whole group: main process and its 2 workers
        assert proc.wait(timeout=120) == EXIT_PREEMPTED, (tmp_path / "out.txt").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert last_checkpoint(run_dir)["global_step"] == 3
    resumed = run_train(*overrides)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "at step 3 (epoch 1, batch 3)" in resumed.stdout
    assert_same_weights(last_checkpoint(straight)["model"],
                        last_checkpoint(run_dir)["model"])
    assert last_checkpoint(run_dir)["data"]["classes"] == ["class_0", "class_1", "class_2"]
    assert json.loads((run_dir / "summary.json").read_text())["data/skipped_files"] == 1


@pytest.mark.dist
def test_done_line_names_the_split_it_measured(straight: Path) -> None:
    """An image folder evaluates on its validation files: the last line says so, not "test"."""
    done = (straight / "train.log").read_text().splitlines()[-1]
    assert "done: validation accuracy " in done, done


def test_two_ranks_under_torchrun_take_equal_batches(tmp_path: Path, folder: Path) -> None:
    counts = tmp_path / "counts"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "--monitor-interval=0.1", "-m", "trainkit.train",
         *folder_run(tmp_path / "run", folder, "data.skip_corrupt=true",
                     "+callbacks.count._target_=tests.helpers.callbacks.CountBatches",
                     f"+callbacks.count.folder={counts}")],
        cwd=REPO, env=offline_env(TRAINKIT_DIST_TIMEOUT_S="60"), capture_output=True,
        text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    per_rank = [json.loads((counts / f"rank{r}.json").read_text()) for r in (0, 1)]
    # 18 files in shards of 9, batches of 4: 3 a rank an epoch, 2 epochs
    assert per_rank[0] == per_rank[1] == {"steps": 6}
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "completed"


def test_truncated_file_without_skip_stops_in_one_line_and_keeps_checkpoints(
        tmp_path: Path, folder: Path, straight: Path) -> None:
    # a copy of the finished 2-epoch run and of its folder, whose one truncated file the run
    # skipped (data.skip_corrupt=true); a third epoch without skip_corrupt meets that file
    root, run_dir = tmp_path / "images", tmp_path / "run"
    shutil.copytree(folder, root)
    shutil.copytree(straight, run_dir)
    before = {p.name: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()}
    cut = sorted((root / "train" / "class_1").glob("*.jpg"))[0]
    result = run_train(*folder_run(run_dir, root, "trainer.max_epochs=3"))
    assert result.returncode == 2
    details, last = error_report(result.stderr)
    assert last.endswith(cut.name), last
    assert "data.skip_corrupt=true" in "\n".join(details), details  # the whole line, long
    assert {p.name: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()} == before

    cut.unlink()  # a class renamed (same count): the checkpoint's classes are not the data's
    for split in ("train", "val"):
        (root / split / "class_2").rename(root / split / "class_z")
    result = run_train(*folder_run(run_dir, root, "trainer.max_epochs=3"))
    assert result.returncode == 2
    _, last = error_report(result.stderr)
    assert "classes differ" in last and "class_2" in last and "class_z" in last, last
    assert {p.name: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()} == before


def test_a_layout_error_is_one_line_through_the_entry_point(tmp_path: Path) -> None:
    root = make_folder(tmp_path / "images", classes=2, per_class=1, val_per_class=1)
    (root / "train" / "class_0" / "labels.csv").write_text("a,b\n")
    result = run_train(*folder_run(tmp_path / "run", root))
    assert result.returncode == 2
    _, last = error_report(result.stderr)
    assert "not an image" in last and last.endswith("labels.csv"), last
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("target", ["tests.image_files.Pictures", "tests.image_files.hf_split"],
                         ids=["torch-Dataset", "hf-datasets"])
def test_own_dataset_trains_and_resumes_mid_epoch_exactly(tmp_path: Path, target: str) -> None:
    if target.endswith("hf_split"):
        pytest.importorskip("datasets")
    root = make_folder(tmp_path / "images", per_class=4, val_per_class=1)
    overrides = [o for o in folder_run(tmp_path / "unused", root) if "hydra.run.dir" not in o]
    (tmp_path / "kept").mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "trainkit.verify_resume", "--steps", "5", "--stop-at", "2",
         f"--keep={tmp_path / 'kept'}", *overrides, "data.name=own",
         f"+dataset._target_={target}"],
        cwd=REPO, env=offline_env(HF_HOME=str(tmp_path / "hf"), HF_DATASETS_OFFLINE="1"),
        capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    checkpoints = list((tmp_path / "kept").rglob("last.pt"))
    assert checkpoints
    for path in checkpoints:
        state = torch.load(path, map_location="cpu", weights_only=True)
        assert state["data"]["classes"] == ["class_0", "class_1", "class_2"]
    shutil.rmtree(tmp_path / "kept")


def test_folder_experiment_and_resnet18_train_with_nothing_else_set(tmp_path: Path) -> None:
    """The README's command, shrunk only in size: `+exp=folder` (AdamW, warmup-cosine, label
    smoothing, EMA, best.pt by val/acc); and `data=image_folder model=resnet18` alone."""
    root = make_folder(tmp_path / "images", classes=2, per_class=2, val_per_class=1)
    shrink = ("data.image_size=32", "data.batch_size=2", "data.num_workers=1",
              "trainer.max_epochs=1", "trainer.precision=32")
    for name, command in (("plain", ("data=image_folder", f"data.root={root}", "model=resnet18")),
                          ("exp", ("+exp=folder", f"data.root={root}"))):
        result = run_train(*command, f"hydra.run.dir={tmp_path / name}", *shrink)
        assert result.returncode == 0, result.stderr[-2000:]
        state = last_checkpoint(tmp_path / name)
        assert state["config"]["model"]["_target_"] == "torchvision.models.resnet18"
        assert state["config"]["model"]["num_classes"] == 2  # ${data.num_classes}
        assert state["config"]["metrics"]["acc"]["num_classes"] == 2
    assert (tmp_path / "exp" / "checkpoints" / "best.pt").is_file()
    assert state["ema"] is not None and state["config"]["loss"]["label_smoothing"] == 0.1


def _mnist_as_png(raw_root: Path, out: Path) -> Path:
    """Real MNIST written out as ``train/<digit>/*.png`` and ``val/<digit>/*.png``."""
    from PIL import Image

    from trainkit.data.sources.tensors import load_mnist

    for split, train in (("train", True), ("val", False)):
        data = load_mnist(raw_root, train=train, download=False)
        for digit in range(10):
            (out / split / str(digit)).mkdir(parents=True)
        for i, (image, label) in enumerate(zip(data.images.numpy(), data.labels.tolist())):
            Image.fromarray(image[0]).save(out / split / str(label) / f"{i:05d}.png",
                                           compress_level=1)
    return out


@pytest.mark.realdata
def test_real_mnist_as_png_folders_reaches_98_5_percent(tmp_path: Path,
                                                         real_mnist_root: Path) -> None:
    """The image path learns as the tensor path does: MnistNet, one epoch of PNGs, grayscale."""
    root = _mnist_as_png(real_mnist_root, tmp_path / "mnist")
    result = run_train(
        "data=image_folder", f"data.root={root}", f"hydra.run.dir={tmp_path / 'run'}",
        "data.channels=1", "data.image_size=28", "data.scale=[1,1]", "data.ratio=[1,1]",
        "data.crop_pct=1", "data.random_flip=false", "data.mean=[0.1307]", "data.std=[0.3081]",
        "data.batch_size=256", "data.eval_batch_size=1000", "data.num_workers=2",
        "model=mnist_net", "optim.lr=0.02", "loss.label_smoothing=0.1", "trainer.max_epochs=1",
        "trainer.max_steps=188", "trainer.precision=auto", "trainer.channels_last=true",
        timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["metrics"]["val/acc"] >= 0.985, summary
