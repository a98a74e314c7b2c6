"""trainkit probe never prints nor advises a figure above 100%: the step alone's rate is steady
(at least the together phase's, which runs the same step), an MFU at or above the peak is left
out, and a matmul slower than the step itself is not advised as trainer.peak_tflops (was:
"5 samples/s together is 145% of the step alone", trainer.peak_tflops=0.001197 advised)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from trainkit.entry.probe import _compute_verdict, _flops_lines, _mfu
from trainkit.loop.step import default_forward
from trainkit.loop.throughput import Phase
from trainkit.observe import flops as flops_module
from trainkit.observe.flops import FlopsMeter

CPU = torch.device("cpu")


def _phase(name: str, rate: float) -> Phase:
    return Phase(name, rate, rate, 0.0, 0.1, 0.01, 1.0, 10)


@pytest.fixture
def slow_matmul(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> float:
    """A matmul measured in a busy moment: 1 MFLOP/s, the machine's best known so far."""
    monkeypatch.setenv("TRAINKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flops_module, "_measured",
                        {(str(CPU), "fp32", torch.get_num_threads()): 1e-6})
    return 1e-6


def _percentages(text: str) -> list[float]:
    return [float(p) for p in re.findall(r"(\d+(?:\.\d+)?)%", text)]


def test_a_step_phase_slowed_by_a_busy_moment_gives_no_ratio_above_100() -> None:
    alone, together = _phase("step", 5.0), _phase("together", 7.25)  # 145% on main
    line = _compute_verdict(SimpleNamespace(data=SimpleNamespace(batch_size=8)),
                            SimpleNamespace(device=CPU), alone, together, {})
    assert "together is 100% of the step alone (7)" in line
    assert max(_percentages(line)) <= 100


def test_the_probe_neither_prints_nor_advises_an_mfu_above_100(slow_matmul: float) -> None:
    model = nn.Linear(4, 2)
    meter = FlopsMeter(model, CPU, "32")  # the peak: the slow matmul
    meter.watch(model)
    default_forward(model, (torch.ones(3, 4), torch.zeros(3)))
    per_sample = meter.per_sample.model
    rate = 3 * slow_matmul * 1e12 / per_sample  # the step: 3x the slow matmul's rate
    report = _mfu(meter, SimpleNamespace(device=CPU), _phase("step", rate),
                  _phase("together", rate / 2))
    assert report["alone"] is None  # at the peak: left out
    assert report["together"] is not None and 0 < report["together"] < 1
    assert report["peak_tflops"] >= report["alone_tflops"]  # raised to the machine's rate
    text = _flops_lines(report)
    assert "trainer.peak_tflops=" not in text and "not a peak to pin" in text
    assert max(_percentages(text)) < 100
