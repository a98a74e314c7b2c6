"""trainer.precision=auto: each branch of the choice with the hardware's facts passed in, the
facts this machine reports, and what a run logs (the choice and why; the slow-bf16 warning)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import REPO
from tests.unit.test_config import EXPERIMENTS, _compose
from trainkit.core.errors import LINE_LIMIT
from trainkit.loop.precision import (
    Hardware,
    Precision,
    choose_precision,
    cpu_bf16,
    cpu_flags,
    slow_bf16_warning,
)

SAPPHIRE = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})


@pytest.mark.parametrize(("hardware", "mode", "why"), [
    (Hardware("cuda", (9, 0)), "bf16-mixed", "compute capability 9.0 has native bf16"),
    (Hardware("cuda", (8, 0)), "bf16-mixed", "compute capability 8.0 has native bf16"),
    (Hardware("cuda", (7, 5)), "16-mixed", "compute capability 7.5 has no native bf16"),
    (Hardware("cuda", (7, 0)), "16-mixed", "compute capability 7.0 has no native bf16"),
    (Hardware("cuda", (9, 0), hip=True), "bf16-mixed", "ROCm GPUs have native bf16"),
    (Hardware("mps"), "32", "fp32 on mps"),
    # a CPU: bf16 only where its instructions are native and torch's kernels may use them
    (Hardware("cpu", cpu_capability="AVX512", cpu_flags=frozenset({"avx512f", "avx512_bf16"})),
     "bf16-mixed", "the CPU has AVX512-BF16"),
    (Hardware("cpu", cpu_capability="AVX512", cpu_flags=SAPPHIRE),
     "bf16-mixed", "the CPU has AVX512-BF16 and AMX"),
    (Hardware("cpu", cpu_capability="AVX2", cpu_flags=frozenset({"avx2", "fma"})),
     "32", "the CPU has no native bf16 (AVX512-BF16 or AMX)"),
    (Hardware("cpu", cpu_capability="AVX512", cpu_flags=frozenset({"avx2", "avx512f"})),
     "32", "the CPU has no native bf16 (AVX512-BF16 or AMX)"),  # Skylake: AVX512 without bf16
    (Hardware("cpu", cpu_capability="AVX2", cpu_flags=SAPPHIRE),  # ATEN_CPU_CAPABILITY=avx2
     "32", "the CPU has AVX512-BF16 and AMX, but torch's CPU kernels use AVX2"),
    (Hardware("cpu", cpu_capability="AVX512", cpu_flags=SAPPHIRE, onednn_max_isa="AVX2"),
     "32", "the CPU has AVX512-BF16 and AMX, but ONEDNN_MAX_CPU_ISA=AVX2 caps oneDNN"),
    (Hardware("cpu", cpu_capability="AVX512", cpu_flags=SAPPHIRE,
              onednn_max_isa="avx512_core_bf16"), "bf16-mixed", "the CPU has AVX512-BF16 and AMX"),
    (Hardware("cpu", cpu_capability="SVE256", cpu_flags=frozenset({"sve", "bf16"})),
     "32", "the CPU has no native bf16 (AVX512-BF16 or AMX)"),  # ARM: fp32, as documented
])
def test_auto_picks_by_the_hardware(hardware: Hardware, mode: str, why: str) -> None:
    assert choose_precision(hardware) == (mode, why)


def test_explicit_bf16_warns_only_on_a_cpu_without_native_bf16() -> None:
    assert slow_bf16_warning(Hardware("cpu", cpu_capability="AVX512", cpu_flags=SAPPHIRE)) is None
    line = slow_bf16_warning(Hardware("cpu", cpu_capability="AVX2", cpu_flags=frozenset()))
    assert line is not None and "several times slower than 32" in line
    assert "\n" not in line and len(line) <= LINE_LIMIT


def test_cpu_flags_are_read_from_the_cpuinfo_file(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\n"
                    "processor\t: 1\nflags\t\t: fpu avx2 avx512_bf16\n")
    assert cpu_flags(str(info)) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()  # not Linux: no flags, fp32


def test_this_machine_gets_what_its_facts_say() -> None:
    hardware = Hardware.of("cpu")
    assert hardware.cpu_capability == torch.backends.cpu.get_cpu_capability()
    precision = Precision("auto", "cpu")
    assert (precision.mode, precision.reason) == choose_precision(hardware)
    assert precision.describe() == f"{precision.mode} (auto: {precision.reason})"
    assert precision.dtype == (torch.bfloat16 if precision.mode == "bf16-mixed" else None)
    assert Precision("32", "cpu").describe() == "32"  # given, not chosen: no reason
    assert cpu_bf16(hardware)[0] == (precision.mode == "bf16-mixed")


@pytest.mark.parametrize("exp", EXPERIMENTS)
def test_the_experiments_default_to_auto(exp: str) -> None:
    cfg = _compose(f"+exp={exp}", "data.root=/data/own")  # +exp=folder names no folder
    assert OmegaConf.to_object(cfg).trainer.precision == "auto"


RUNS = textwrap.dedent("""
    import sys
    from pathlib import Path
    import torch
    from torch import nn
    from trainkit import Trainer, TrainerConfig
    root = Path(sys.argv[1])
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(2)]
    for mode in ("auto", "bf16-mixed"):
        model = nn.Linear(4, 2)
        Trainer(TrainerConfig(precision=mode, max_steps=2, hang_timeout_s=0),
                run_dir=root / mode).fit(model, torch.optim.SGD(model.parameters(), lr=0.1), data)
""")


def test_a_run_says_what_auto_chose_and_warns_of_slow_bf16(tmp_path: Path) -> None:
    # ATEN_CPU_CAPABILITY=avx2: torch's kernels without AVX512, as on a CPU with AVX2 only
    env = {"ATEN_CPU_CAPABILITY": "avx2", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", RUNS, str(tmp_path)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    auto = (tmp_path / "auto" / "train.log").read_text().splitlines()
    assert "precision 32 (auto: " in auto[0] and "started in" in auto[0], auto[0]
    assert not any("slower" in line for line in auto)
    bf16 = (tmp_path / "bf16-mixed" / "train.log").read_text().splitlines()
    assert "precision bf16-mixed, " in bf16[0], bf16[0]
    assert len([line for line in bf16 if "several times slower than 32" in line]) == 1, bf16
    summary = json.loads((tmp_path / "bf16-mixed" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["setup_s"] > 0
    assert summary["startup_s"] is None  # the process's second fit: only its own set-up
