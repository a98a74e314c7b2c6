"""Issue 21.1 through the real entry point: a finished run given more steps or epochs, and a
new run started from another run's checkpoint (``checkpoint.init_from``)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    assert_same_weights,
    error_report,
    last_checkpoint,
    run_train,
    run_train_many,
    tiny_run,
)

pytestmark = pytest.mark.slow


def _lrs(run_dir: Path) -> dict[int, float]:
    """train/lr by step, from metrics.jsonl (a later line of a step wins)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["train/lr"] for r in map(json.loads, lines) if "train/lr" in r}


def _parameters(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The learned weights, without batch-norm statistics (training moves those at lr 0)."""
    return {k: v for k, v in weights.items() if "running_" not in k and "num_batches" not in k}


EMA = "trainer.ema_decay=0.9"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory, mnist_root: Path) -> Path:
    """One finished 6-step run with an EMA, shared: the run the first test extends (a copy of
    it) and the checkpoint the init_from tests start from. Only read, never resumed in place."""
    run = tmp_path_factory.mktemp("source")
    first = run_train(*tiny_run(run, mnist_root, "trainer.max_steps=6", EMA))
    assert first.returncode == 0, first.stderr[-2000:]
    return run


def test_a_finished_run_takes_more_steps_on_a_replanned_schedule(
        tmp_path: Path, mnist_root: Path, source: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(source, run)  # the finished 6-step run, extended here
    final_lr = _lrs(run)[6]
    more = run_train(*tiny_run(run, mnist_root, "trainer.max_steps=12", EMA))
    assert more.returncode == 0, more.stderr[-2000:]
    assert "resumed from" in more.stdout and "at step 6 " in more.stdout
    assert "LR schedule is re-planned over 12 steps from step 6" in more.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 12
    assert last_checkpoint(run)["global_step"] == 12
    # the re-planned one-cycle schedule is the one a 12-step run follows from step 6 on
    straight = tmp_path / "straight"
    assert run_train(*tiny_run(straight, mnist_root, "trainer.max_steps=12", EMA)).returncode == 0
    extended, planned = _lrs(run), _lrs(straight)
    for step in (8, 10, 12):
        assert extended[step] == pytest.approx(planned[step], rel=1e-9)
    assert extended[8] > final_lr  # not stuck at the annealed end of the 6-step schedule


def test_a_finished_run_takes_more_epochs(tmp_path: Path, mnist_root: Path) -> None:
    run = tmp_path / "run"
    assert run_train(*tiny_run(run, mnist_root, "trainer.max_epochs=1")).returncode == 0
    more = run_train(*tiny_run(run, mnist_root, "trainer.max_epochs=2"))
    assert more.returncode == 0, more.stderr[-2000:]
    assert "re-planned over 32 steps from step 16" in more.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["epoch"], summary["global_step"]) == ("completed", 2, 32)


def test_init_from_starts_a_new_run_from_the_weights_alone(tmp_path: Path, mnist_root: Path,
                                                          source: Path) -> None:
    saved = last_checkpoint(source)
    tuned = tmp_path / "tuned"
    # lr 0 leaves the weights where they started: the checkpoint's
    result = run_train(*tiny_run(tuned, mnist_root, "trainer.max_steps=3", "sched=constant",
                                 "optim.lr=0.0", "trainer.ema_decay=0.9",
                                 f"checkpoint.init_from={source / 'checkpoints' / 'last.pt'}"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "initialized the weights from" in result.stdout and "resumed" not in result.stdout
    state = last_checkpoint(tuned)
    assert_same_weights(_parameters(state["model"]), _parameters(saved["model"]))
    assert state["ema"]["updates"] == saved["ema"]["updates"] + 3  # its EMA, continued
    # fresh counters, optimizer and schedule
    assert state["global_step"] == 3 and state["trainer"]["samples_seen"] == 3 * 32
    assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {3}
    assert state["scheduler"]["last_epoch"] == 3
    # a re-run of the fine-tuning command resumes it (from its own checkpoint)
    again = run_train(*tiny_run(tuned, mnist_root, "trainer.max_steps=3", "sched=constant",
                                "optim.lr=0.0", "trainer.ema_decay=0.9",
                                f"checkpoint.init_from={source / 'checkpoints' / 'last.pt'}"))
    assert again.returncode == 0 and "resumed from" in again.stdout


@pytest.fixture(scope="module")
def init_from_errors(tmp_path_factory: pytest.TempPathFactory, mnist_root: Path,
                     source: Path) -> tuple[Path, dict[str, subprocess.CompletedProcess[str]]]:
    """The two bad init_from runs, in one process (:func:`run_train_many`): from a checkpoint of
    another model ("other", into ``<folder>/other``) and from a missing file ("missing")."""
    folder = tmp_path_factory.mktemp("init_from_errors")
    ckpt = source / "checkpoints" / "last.pt"
    runs = {"other": tiny_run(folder / "other", mnist_root, "model.widths=[8,16,32]",
                              f"checkpoint.init_from={ckpt}"),
            "missing": tiny_run(folder / "run", mnist_root,
                                f"checkpoint.init_from={folder / 'none.pt'}")}
    before = ckpt.read_bytes()
    results = run_train_many(runs, folder / "results")
    assert ckpt.read_bytes() == before  # nothing deleted or changed
    return folder, results


def test_init_from_a_checkpoint_of_another_model_is_one_line(
        init_from_errors: tuple[Path, dict[str, subprocess.CompletedProcess[str]]],
        source: Path) -> None:
    ckpt = source / "checkpoints" / "last.pt"
    folder, results = init_from_errors
    other, result = folder / "other", results["other"]
    assert result.returncode == 2
    details, last = error_report(result.stderr)
    assert "checkpoint.init_from" in last and "does not fit this model" in last
    assert "of another shape (" in last  # counts the differences and names the first
    assert any(str(ckpt) in line for line in details)
    assert not list((other / "checkpoints").glob("*.pt"))


def test_init_from_a_missing_file_names_the_key(
        init_from_errors: tuple[Path, dict[str, subprocess.CompletedProcess[str]]]) -> None:
    result = init_from_errors[1]["missing"]
    assert result.returncode == 2
    _, last = error_report(result.stderr)
    assert "does not exist" in last and "checkpoint.init_from" in last


def test_library_init_from_is_the_same_key(tmp_path: Path, mnist_root: Path,
                                           source: Path) -> None:
    """The library equivalent: CheckpointConfig(init_from=...)."""
    from trainkit import CheckpointConfig, Trainer, TrainerConfig, load_mnist
    from trainkit.data import InMemoryLoader
    from trainkit.models import MnistNet

    data = InMemoryLoader(load_mnist(mnist_root, train=True, verify=False, download=False), 32,
                          shuffle=True)
    model = MnistNet()
    trainer = Trainer(TrainerConfig(device="cpu", max_steps=1), run_dir=tmp_path / "lib",
                      checkpoint=CheckpointConfig(
                          init_from=str(source / "checkpoints" / "last.pt")))
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.0), data)
    assert_same_weights(_parameters(model.state_dict()),
                        _parameters(last_checkpoint(source)["model"]))
    assert trainer.state.global_step == 1
