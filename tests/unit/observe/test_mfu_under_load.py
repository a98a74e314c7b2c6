"""MFU is under 100% by construction: a CPU run whose peak matmul is measured while the machine
is busy (threads spinning beside it, holding the interpreter), and which then trains at full
speed, reports no MFU of 1 or more, in metrics.jsonl or its summary; the measured peak is the
machine's best, kept across runs (was: MFU 112-175%, the peak of one busy moment)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from trainkit import Trainer
from trainkit.config import TrainerConfig
from trainkit.models.mnist import MnistNet
from trainkit.observe import flops as flops_module
from trainkit.observe import peaks

CPU = torch.device("cpu")


@pytest.fixture
def fresh_peaks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No peak remembered: neither this process's nor a cache file's."""
    monkeypatch.setattr(flops_module, "_measured", {})
    monkeypatch.setenv("TRAINKIT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "peaks.json"


class BusyPool:
    """Threads busy with matmuls of their own, beside a run on 2 threads: its 2-thread matmuls
    wait for cores the pool holds, so the peak measured at its first step reads slow, as on a
    machine busy with other work."""

    def __init__(self, threads: int = 6) -> None:
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._spin, daemon=True) for _ in range(threads)]

    def _spin(self) -> None:
        a = torch.randn(512, 512)
        while not self.stop.is_set():
            a @ a

    def on_fit_start(self, trainer: object) -> None:
        for thread in self.threads:  # busy while the first step measures the peak
            thread.start()

    def on_step_end(self, trainer: object, step: int) -> None:
        self.stop.set()  # full speed from here

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            if thread.is_alive():
                thread.join()


@pytest.fixture
def busy() -> Iterator[BusyPool]:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    pool = BusyPool()
    yield pool
    pool.close()
    torch.set_num_threads(threads)


def test_a_run_under_load_never_reports_mfu_of_1_or_more(fresh_peaks: Path, busy: BusyPool,
                                                         tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = [(torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))) for _ in range(4)]
    model = MnistNet()  # +exp=mnist's: its convolutions beat a busy moment's matmul
    run_dir = tmp_path / "run"
    trainer = Trainer(TrainerConfig(max_steps=12, max_epochs=100, log_every_n_steps=3,
                                    device="cpu", advice=False), run_dir=run_dir,
                      callbacks=[busy])
    summary = trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.01), data)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    mfus = [line["throughput/mfu"] for line in lines if "throughput/mfu" in line]
    assert all(0 < mfu < 1 for mfu in mfus), mfus
    assert summary["tflops"] > 0 and 0 < summary.get("mfu", 0.5) < 1
    assert summary["tflops"] < summary["peak_tflops"]
    log = (run_dir / "train.log").read_text()
    assert not any(f"MFU {p}%" in log for p in range(100, 1000))


def test_the_peak_is_the_best_kept_for_this_machine(fresh_peaks: Path) -> None:
    key = peaks.machine_key(CPU, "fp32")
    assert f"{torch.get_num_threads()} threads" in key and "cpu" in key
    first = flops_module.measure_matmul_tflops(CPU, "fp32", seconds=0.05)
    assert json.loads(fresh_peaks.read_text()) == {key: first}
    # a later process: the kept figure where it is larger, the measurement where that is
    assert peaks.best_known(key, first / 10) == first
    assert peaks.best_known(key, first * 2) == first * 2
    assert json.loads(fresh_peaks.read_text()) == {key: first * 2}
    fresh_peaks.write_text("not json")  # a broken cache: the measurement alone
    assert peaks.best_known(key, 1.0) == 1.0 and json.loads(fresh_peaks.read_text()) == {key: 1.0}


def test_a_window_at_or_above_its_peak_gives_no_mfu(fresh_peaks: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Linear(4, 2)
    meter = flops_module.FlopsMeter(model, CPU, "32", peak_tflops=1e-6)
    meter.watch(model)
    model(torch.ones(3, 4))
    per_sample = meter.per_sample.model  # 32 FLOPs: 1e-6 TFLOP/s is 31250 samples/s
    below = meter.rates(0.5e6 / per_sample)
    assert below["throughput/mfu"] == pytest.approx(0.5)
    with caplog.at_level("INFO", logger="trainkit"):
        above = meter.rates(2e6 / per_sample)
    assert "throughput/mfu" not in above and above["throughput/tflops"] == pytest.approx(2e-6)
    assert "the peak (1e-06, trainer.peak_tflops (fp32)) is too low" in caplog.text
    assert meter.peak[0] == 1e-6  # a given peak stays

    measured = flops_module.FlopsMeter(model, CPU, "32")
    measured.watch(model)
    model(torch.ones(3, 4))
    peak = measured.peak[0]
    faster = 2 * peak * 1e12 / per_sample  # twice the peak: a busy moment's measurement
    assert "throughput/mfu" not in measured.rates(faster)
    assert measured.peak[0] == pytest.approx(2 * peak)  # the rate the machine reached
    assert measured.rates(faster / 2)["throughput/mfu"] == pytest.approx(0.5)
    assert flops_module.measure_matmul_tflops(CPU, "fp32") == pytest.approx(2 * peak)
