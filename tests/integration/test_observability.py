"""What a user watching a run sees: TensorBoard tags, the console in a terminal and in a pipe,
train.log, summary.json, and the out-of-memory diagnosis."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import REPO, error_report, offline_env, run_train, tiny_run

pytestmark = pytest.mark.slow

WINDOW_TAGS = ("train/loss", "train/lr", "throughput/samples_per_s", "throughput/steps_per_s",
               "time/step_ms", "time/data_wait_pct", "memory/cpu_rss_gib", "optim/grad_norm",
               "amp/loss_scale", "amp/skipped_steps")


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory: pytest.TempPathFactory, mnist_root: Path) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("run")
    result = run_train(*tiny_run(run_dir, mnist_root, "trainer.max_steps=12",
                                 "trainer.precision=16-mixed", "trainer.gradient_clip_val=1.0"))
    assert result.returncode == 0, result.stderr[-2000:]
    return run_dir, result.stdout


def test_every_window_tag_is_logged_each_window(fp16_run: tuple[Path, str]) -> None:
    run_dir, _ = fp16_run
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    tags = events.Tags()["scalars"]
    for tag in WINDOW_TAGS:
        assert [e.step for e in events.Scalars(tag)] == [2, 4, 6, 8, 10, 12], tag
    assert [e.step for e in events.Scalars("val/acc")] == [12]
    assert not [t for t in tags if t.startswith("memory/cuda")]  # CPU run: no CUDA tags
    rss = events.Scalars("memory/cpu_rss_gib")[-1].value
    assert 0.05 < rss < 64
    wait = [e.value for e in events.Scalars("time/data_wait_pct")]
    assert all(0 <= w < 100 for w in wait)
    assert all(e.value > 0 for e in events.Scalars("throughput/samples_per_s"))
    assert events.Scalars("amp/loss_scale")[-1].value >= 1


def test_hyperparameters_are_logged_with_final_metrics(fp16_run: tuple[Path, str]) -> None:
    run_dir, _ = fp16_run
    events = EventAccumulator(str(run_dir / "tb" / "hparams"))
    events.Reload()
    assert "hparam/val/acc" in events.Tags()["scalars"]
    plugins = events.PluginTagToContent("hparams")
    assert "_hparams_/session_start_info" in plugins
    assert b"trainer.precision" in plugins["_hparams_/session_start_info"]


def test_piped_console_and_train_log_are_plain_lines(fp16_run: tuple[Path, str]) -> None:
    run_dir, stdout = fp16_run
    assert "\r" not in stdout
    log_text = (run_dir / "train.log").read_text()
    assert "\r" not in log_text
    console_lines = [line for line in stdout.splitlines() if " step " in line]
    assert len(console_lines) == 7  # six windows and one evaluation
    for line in console_lines:
        assert line in log_text
    assert "samples/s data wait" in console_lines[0] and "GiB" in console_lines[0]


def test_summary_reports_throughput_and_peak_memory(fp16_run: tuple[Path, str]) -> None:
    run_dir, _ = fp16_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 12
    assert summary["samples_per_s"] > 0 and summary["steps_per_s"] > 0
    assert 0.05 < summary["peak_memory"]["cpu_peak_rss_gib"] < 64
    assert set(summary["metrics"]) == {"val/loss", "val/acc"}


def test_a_terminal_gets_a_live_progress_bar(tmp_path: Path, mnist_root: Path) -> None:
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # rows, cols
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainkit.train",
         *tiny_run(tmp_path / "run", mnist_root, "trainer.max_epochs=3", "trainer.max_steps=40")],
        cwd=REPO, env=offline_env(), stdin=secondary, stdout=secondary, stderr=secondary)
    os.close(secondary)
    output = b""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        output += chunk
    os.close(primary)
    assert proc.wait(timeout=60) == 0, output[-2000:]
    text = output.decode(errors="replace")
    # A terminal turns "\n" into "\r\n"; a bar redraws with "\r" and no newline.
    redraws = [part for part in text.split("\r") if "/40 [" in part and "\n" not in part]
    assert redraws, text[-2000:]
    assert any("step/s" in part or "s/step" in part for part in redraws)  # live rate and ETA
    assert any("loss=" in part and "samples_s=" in part for part in redraws)  # the postfix
    # the log file stays plain even when the console had a bar
    assert "\r" not in (tmp_path / "run" / "train.log").read_text()


def test_out_of_memory_is_one_diagnosis_and_keeps_checkpoints(tmp_path: Path,
                                                             mnist_root: Path) -> None:
    run_dir = tmp_path / "run"
    assert run_train(*tiny_run(run_dir, mnist_root, "trainer.max_steps=2")).returncode == 0
    before = (run_dir / "checkpoints" / "last.pt").read_bytes()
    result = run_train(*tiny_run(run_dir, mnist_root, "trainer.max_steps=4",
                                 "checkpoint.resume=null",
                                 "model._target_=tests.helpers.models.OutOfMemoryNet"))
    assert result.returncode == 2
    details, last = error_report(result.stderr)
    assert "out of memory on cpu at step 2 with batch 32" in last
    assert "data.batch_size" in last and "accumulate_grad_batches" in last
    assert "bf16-mixed" in last
    assert "precision 32" in details[0] and "checkpoints are untouched" in details[-1]
    assert (run_dir / "checkpoints" / "last.pt").read_bytes() == before
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["global_step"] == 2
