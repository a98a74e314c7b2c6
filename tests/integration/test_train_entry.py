"""The real entry point, `python -m trainkit.train`, in subprocesses on generated MNIST files."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import (
    REPO,
    assert_same_weights,
    error_report,
    last_checkpoint,
    offline_env,
    run_train,
    tiny_run,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory, mnist_root: Path) -> Path:
    run_dir = tmp_path_factory.mktemp("run")
    result = run_train(*tiny_run(run_dir, mnist_root, "trainer.max_epochs=2"))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def test_run_reports_its_startup_time(finished_run: Path) -> None:
    # process start to the first step: in the summary and in the log's first line
    startup = json.loads((finished_run / "summary.json").read_text())["startup_s"]
    first = (finished_run / "train.log").read_text().splitlines()[0]
    assert 0 < startup < 300
    assert re.search(r"started in (\d+\.\d) s", first).group(1) == f"{startup:.1f}", first


def test_summary_follows_the_contract(finished_run: Path) -> None:
    summary = json.loads((finished_run / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["world_size"] == 1
    assert summary["epoch"] == 2
    assert summary["global_step"] == 2 * 16  # 512 samples / batch 32, two epochs
    assert summary["wall_time_s"] > 0 and summary["samples_per_s"] > 0
    # the final figures are the last evaluation's, as logged
    last_eval = [r for r in map(json.loads, (finished_run / "metrics.jsonl").read_text()
                                .splitlines()) if "val/acc" in r][-1]
    assert summary["metrics"]["val/acc"] == last_eval["val/acc"]
    assert summary["metrics"]["val/loss"] == last_eval["val/loss"] > 0
    # the generated digits are easy: a working loop learns them in two short epochs
    assert summary["metrics"]["val/acc"] > 0.5


def test_last_checkpoint_is_plain_and_loadable(finished_run: Path) -> None:
    state = torch.load(finished_run / "checkpoints" / "last.pt", map_location="cpu",
                       weights_only=True)
    assert state["global_step"] == 32
    assert {"model", "optimizer", "scheduler", "precision", "rng", "config"} <= state.keys()
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in state["model"])
    assert state["config"]["trainer"]["max_epochs"] == 2
    assert not list((finished_run / "checkpoints").glob(".*tmp"))


def test_tensorboard_has_loss_and_lr(finished_run: Path) -> None:
    events = EventAccumulator(str(finished_run / "tb"))
    events.Reload()
    tags = events.Tags()["scalars"]
    for tag in ("train/loss", "train/lr", "val/acc", "val/loss"):
        assert tag in tags, tags
    assert len(events.Scalars("train/loss")) == 32 // 2  # log_every_n_steps=2
    assert [e.step for e in events.Scalars("val/acc")] == [16, 32]  # once per epoch


def test_train_log_holds_the_console_lines(finished_run: Path) -> None:
    text = (finished_run / "train.log").read_text()
    assert "training MnistNet" in text
    assert "val/acc" in text and "done: test accuracy" in text
    assert "\r" not in text


def test_a_limit_cutting_the_other_short_is_said_among_the_first_lines(
        finished_run: Path) -> None:
    # +exp=mnist's max_steps: 188 and this run's max_epochs=2 of 16 steps
    first = (finished_run / "train.log").read_text().split(" step ")[0]
    assert ("trainer.max_epochs=2 ends the run after 32 steps (16 an epoch), before "
            "trainer.max_steps=188") in first


def assert_epochs_count_from_1(log: str, per_epoch: int) -> set[int]:
    """Every step and evaluation line names step S's epoch as ceil(S / per_epoch); returns
    the epochs named. (Once an epoch's last step and its evaluation said the next epoch.)"""
    named = [(int(e), int(s)) for e, s in re.findall(r"\bepoch (\d+) step (\d+)\b", log)]
    assert named, log
    assert all(e == math.ceil(s / per_epoch) for e, s in named), named
    return {e for e, _ in named}


def test_log_lines_count_epochs_from_1(finished_run: Path) -> None:
    log = (finished_run / "train.log").read_text()
    assert assert_epochs_count_from_1(log, 16) == {1, 2}  # 512 samples / batch 32
    assert "epoch 1 step 16 val/loss" in log and "epoch 2 step 32 val/loss" in log
    assert json.loads((finished_run / "summary.json").read_text())["epoch"] == 2


def test_hydra_saved_the_composed_config(finished_run: Path) -> None:
    assert (finished_run / ".hydra" / "config.yaml").is_file()


def test_rerun_in_same_dir_resumes_and_matches_an_uninterrupted_run(
    tmp_path: Path, mnist_root: Path
) -> None:
    common = ("sched=constant", "trainer.max_epochs=3")
    straight = tmp_path / "straight"
    assert run_train(*tiny_run(straight, mnist_root, *common, "trainer.max_steps=20")
                     ).returncode == 0
    resumed = tmp_path / "resumed"
    first = run_train(*tiny_run(resumed, mnist_root, *common, "trainer.max_steps=11"))
    assert first.returncode == 0, first.stderr[-2000:]
    # the same command with a larger budget continues from step 11 (mid-epoch), not from 0
    second = run_train(*tiny_run(resumed, mnist_root, *common, "trainer.max_steps=20"))
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from" in second.stdout and "at step 11 (epoch 1, batch 11)" in second.stdout
    b = last_checkpoint(resumed)["model"]
    assert_same_weights(last_checkpoint(straight)["model"], b)
    # once more: the run is finished, nothing trains, and the summary still reports metrics
    third = run_train(*tiny_run(resumed, mnist_root, *common, "trainer.max_steps=20"))
    assert third.returncode == 0, third.stderr[-2000:]
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["global_step"] == 20 and "val/acc" in summary["metrics"]
    assert "at step 20 (epoch 2, batch 4)" in third.stdout
    assert assert_epochs_count_from_1((resumed / "train.log").read_text(), 16) == {1, 2}
    assert_same_weights(last_checkpoint(resumed)["model"], b)


def test_multirun_sweeps_learning_rates(tmp_path: Path, mnist_root: Path) -> None:
    overrides = [o for o in tiny_run(tmp_path, mnist_root, "trainer.max_steps=3")
                 if not o.startswith("hydra.run.dir")]
    result = run_train("-m", *overrides, "optim.lr=0.01,0.05", f"hydra.sweep.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-2000:]
    lrs = []
    for job in ("0", "1"):
        state = torch.load(tmp_path / job / "checkpoints" / "last.pt", weights_only=True)
        lrs.append(state["config"]["optim"]["lr"])
        assert json.loads((tmp_path / job / "summary.json").read_text())["global_step"] == 3
    assert lrs == [0.01, 0.05]


BAD_INPUTS = [
    ("data.batch_size=-4", "data.batch_size must be >= 1"),
    ("data.batch_size=2.5", "data.batch_size"),
    ("trainer.precision=fp8", "trainer.precision"),
    ("trainer.device=cuda", "CUDA is not available"),
    ("trainer.accumulate_grad_batches=0", "accumulate_grad_batches must be >= 1"),
    ("trainer.max_steps=-3", "trainer.max_steps must be >= -1"),
    ("trainer.max_epochs=-1", "trainer.max_epochs must be >= 1"),
    ("trainer.no_such_key=1", "no_such_key"),
    # Hydra's advice after a typo, followed: the key is added, and nothing reads it
    ("+trainer.max_step=20", "trainer.max_step is not a setting: did you mean trainer.max_steps?"),
    ("optim._target_=torch.optim.NoSuchOptimizer", "NoSuchOptimizer"),
]
# These also print details before the last line: why CUDA is missing, the import error.
WITH_DETAILS = ("trainer.device=cuda", "optim._target_=torch.optim.NoSuchOptimizer")


def _bad_runs(folder: Path, mnist_root: Path) -> dict[str, list[str]]:
    """The entry point's arguments for each bad-input run, by the name of its folder."""
    runs = {str(i): [*tiny_run(folder / str(i) / "run", mnist_root, "trainer.max_steps=2"),
                     override] for i, (override, _) in enumerate(BAD_INPUTS)}
    runs["unknown_exp"] = ["+exp=nope", f"hydra.run.dir={folder / 'unknown_exp' / 'run'}"]
    # download stays on (the default): offline it must fail fast with one line
    (folder / "missing_data" / "empty").mkdir(parents=True)
    runs["missing_data"] = ["+exp=mnist", f"hydra.run.dir={folder / 'missing_data' / 'run'}",
                            f"data.root={folder / 'missing_data' / 'empty'}"]
    return runs


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory: pytest.TempPathFactory, mnist_root: Path) -> Path:
    """Each run of :func:`_bad_runs` by the entry point, all in one process
    (tests/helpers/entry_runs.py: one interpreter, torch and Hydra start instead of one a run);
    run ``name`` in ``<folder>/<name>``, its outputs as ``result.{status,out,err}`` there."""
    folder = tmp_path_factory.mktemp("bad")
    runs = _bad_runs(folder, mnist_root)
    for name in runs:
        (folder / name).mkdir(exist_ok=True)
    spec = [{"argv": argv, "prefix": str(folder / name / "result")} for name, argv in runs.items()]
    (folder / "runs.json").write_text(json.dumps(spec))
    done = subprocess.run([sys.executable, "-m", "tests.helpers.entry_runs",
                           str(folder / "runs.json")], cwd=REPO, env=offline_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


def _result(here: Path) -> tuple[int, str, str]:
    """A run's exit status, stdout and stderr, from ``bad_input_runs``."""
    return (int((here / "result.status").read_text()), (here / "result.out").read_text(),
            (here / "result.err").read_text())


@pytest.mark.parametrize(("override", "fragment"), BAD_INPUTS)
def test_bad_input_is_one_line_and_nonzero(bad_input_runs: Path, override: str,
                                            fragment: str) -> None:
    if override == "trainer.device=cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    here = bad_input_runs / str([o for o, _ in BAD_INPUTS].index(override))
    status, stdout, stderr = _result(here)
    assert status != 0
    details, last = error_report(stderr)  # the last line: <= 200 characters
    assert bool(details) == (override in WITH_DETAILS), stderr
    assert fragment in last, last
    assert "Traceback" not in stdout + stderr
    # no folder of Hydra's files alone: either none, or one whose train.log says what failed
    run_dir = here / "run"
    assert not run_dir.exists() or last in (run_dir / "train.log").read_text()


def test_config_error_leaves_no_outputs_folder(tmp_path: Path, mnist_root: Path) -> None:
    """Hydra makes outputs/<date>/<time>/ before the job checks the values: taken back."""
    (tmp_path / "runs").mkdir()  # a folder of the user's, empty: it stays
    here = offline_env(PYTHONPATH=str(REPO))  # this checkout's trainkit, from another folder
    for where in ([], ["hydra.run.dir=runs/a"]):
        result = subprocess.run(
            [sys.executable, "-m", "trainkit.train", "+exp=mnist", f"data.root={mnist_root}",
             "data.batch_size=-4", *where],
            cwd=tmp_path, env=here, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stderr
        assert "data.batch_size must be >= 1" in error_report(result.stderr)[1]
        assert sorted(p.name for p in tmp_path.rglob("*")) == ["runs"]


def test_unknown_experiment_lists_the_known_ones(bad_input_runs: Path) -> None:
    status, _, stderr = _result(bad_input_runs / "unknown_exp")
    assert status != 0
    details, last = error_report(stderr)
    assert not details and "exp/nope" in last and "mnist" in last, stderr


def test_missing_data_offline_names_the_files(bad_input_runs: Path) -> None:
    tmp_path = bad_input_runs / "missing_data"
    empty = tmp_path / "empty"
    status, _, stderr = _result(tmp_path)
    assert status != 0
    details, last = error_report(stderr)  # was one line of ~900 characters
    assert "download failed" in last and "python -m trainkit.data download mnist" in last
    # the details name the folder, the missing files and the download's exception chain
    assert f"{empty / 'MNIST' / 'raw'} lacks train-images-idx3-ubyte" in details[0]
    assert "t10k-labels-idx1-ubyte" in details[0]
    assert any(line.startswith("  download error: ") for line in details), details
    # a run that never started leaves no folder (its lines are the ones above), nor MNIST/raw
    assert not (tmp_path / "run").exists() and not list(empty.iterdir())


def test_bad_input_deletes_no_checkpoint(tmp_path: Path, mnist_root: Path,
                                        finished_run: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)  # a completed run in precision 32, of its own
    before = (run_dir / "checkpoints" / "last.pt").read_bytes()
    log_before = (run_dir / "train.log").read_text()
    result = run_train(*tiny_run(run_dir, mnist_root, "trainer.max_epochs=2"),
                       "trainer.precision=16-mixed")  # a checkpoint of another precision
    assert result.returncode != 0
    details, last = error_report(result.stderr)
    assert "precision" in last
    assert "another hydra.run.dir" in last  # the library's run_dir, in the entry point's words
    assert "trainer.precision: 32 -> 16-mixed" in "\n".join(details)
    assert (run_dir / "checkpoints" / "last.pt").read_bytes() == before
    # issue 61, fault 1: a refused start leaves the run's log as it was (the lines went to the
    # console alone)
    assert (run_dir / "train.log").read_text() == log_before


@pytest.mark.realdata
def test_mnist_reaches_99_percent_on_real_data(tmp_path: Path, real_mnist_root: Path) -> None:
    result = run_train("+exp=mnist", f"hydra.run.dir={tmp_path}",
                       env=offline_env(TRAINKIT_DATA_DIR=str(real_mnist_root)))
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["metrics"]["val/acc"] >= 0.99, summary


def test_metrics_jsonl_holds_one_object_per_logging_step(finished_run: Path) -> None:
    """The contract's metrics.jsonl: one JSON object per logging step, with its step; the same
    figures as TensorBoard's (read back with tensorboard's own reader)."""
    lines = (finished_run / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(2, 33, 2))  # log_every_n_steps=2
    assert all("train/lr" in r and "throughput/samples_per_s" in r for r in train)
    assert [r["step"] for r in records if "val/acc" in r] == [16, 32]  # once per epoch
    events = EventAccumulator(str(finished_run / "tb"))
    events.Reload()
    tb_loss = [e.value for e in events.Scalars("train/loss")]
    assert tb_loss == pytest.approx([r["train/loss"] for r in train], rel=1e-6)


def test_mfu_is_in_tensorboard_metrics_summary_and_the_done_line(finished_run: Path) -> None:
    """issue 53: FLOPs counted once, MFU against the CPU's measured matmul peak, everywhere."""
    summary = json.loads((finished_run / "summary.json").read_text())
    assert summary["flops_per_sample"] > 0 and summary["peak_source"].startswith("measured: ")
    assert 0 < summary["mfu"] == pytest.approx(summary["tflops"] / summary["peak_tflops"])
    logged = [json.loads(line) for line in (finished_run / "metrics.jsonl").read_text()
              .splitlines()]
    train = [line for line in logged if "train/loss" in line]
    assert train and all(line["throughput/mfu"] > 0 for line in train)
    events = EventAccumulator(str(finished_run / "tb"))
    events.Reload()
    assert len(events.Scalars("throughput/mfu")) == len(train)
    assert len(events.Scalars("throughput/tflops")) == len(train)
    done = (finished_run / "train.log").read_text().splitlines()[-1]
    assert f"; MFU {summary['mfu']:.0%} (" in done, done
