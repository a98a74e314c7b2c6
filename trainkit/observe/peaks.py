"""Peak dense TFLOP/s of common GPUs, per precision: the denominator of a run's MFU.

From the vendors' datasheets (NVIDIA's product datasheets; the GeForce cards from the Ampere
GA102 and Ada AD102 whitepapers), dense figures: where a sheet gives only the 2:4-sparsity
figure (marked ``*`` there) it is halved. ``tf32``/``bf16``/``fp16`` are tensor-core figures
with FP32 accumulation (what PyTorch's matmuls use); ``fp32`` is the non-tensor figure.
A card missing here, or a precision its sheet lacks, has no entry: the run then measures a matmul
instead (:mod:`trainkit.observe.flops`), and ``trainer.peak_tflops`` overrides either.

A measured peak is the machine's, not the moment's: the best figure seen on this machine (per
device, precision and CPU thread count) is kept across runs in ``<cache>/peaks.json``
(``$TRAINKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/trainkit``, else ``~/.cache/trainkit``), so a
measurement taken on a busy machine does not become the denominator of the next run's MFU.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch


class Peak(NamedTuple):
    """One card's figures in TFLOP/s (None: the card has no such unit)."""

    name: str
    fp32: float
    tf32: float | None
    bf16: float | None
    fp16: float


# (pattern on torch.cuda.get_device_name().lower(), figures); the first match wins, so the
# specific names (H100 PCIe, L40S, A10G) come before the general ones (H100, L40, A10)
GPUS: tuple[tuple[str, Peak], ...] = (
    (r"h100.*pcie", Peak("H100 PCIe", 51.0, 756 / 2, 1513 / 2, 1513 / 2)),
    (r"h100.*nvl", Peak("H100 NVL", 60.0, 835 / 2, 1671 / 2, 1671 / 2)),
    (r"gh200", Peak("GH200", 67.0, 989 / 2, 1979 / 2, 1979 / 2)),
    (r"h100", Peak("H100 SXM", 67.0, 989 / 2, 1979 / 2, 1979 / 2)),
    (r"h200.*nvl", Peak("H200 NVL", 60.0, 835 / 2, 1671 / 2, 1671 / 2)),
    (r"h200", Peak("H200 SXM", 67.0, 989 / 2, 1979 / 2, 1979 / 2)),
    (r"a100", Peak("A100", 19.5, 156.0, 312.0, 312.0)),  # SXM and PCIe alike
    # the L40 and L40S sheets give both figures ("dense | sparse*"): the dense ones
    (r"l40s", Peak("L40S", 91.6, 183.0, 362.05, 362.05)),
    (r"l40\b", Peak("L40", 90.5, 90.5, 181.05, 181.05)),
    (r"\bl4\b", Peak("L4", 30.3, 120 / 2, 242 / 2, 242 / 2)),
    (r"a40\b", Peak("A40", 37.4, 74.8, 149.7, 149.7)),
    # AWS's A10G: NVIDIA publishes only the A10's sheet
    (r"a10g?\b", Peak("A10/A10G", 31.2, 62.5, 125.0, 125.0)),
    (r"v100s", Peak("V100S PCIe", 16.4, None, None, 130.0)),
    (r"v100.*pcie", Peak("V100 PCIe", 14.0, None, None, 112.0)),
    (r"v100", Peak("V100 SXM2", 15.7, None, None, 125.0)),
    (r"\bt4\b", Peak("T4", 8.1, None, None, 65.0)),
    (r"rtx 4090", Peak("RTX 4090", 82.6, 82.6, 165.2, 165.2)),
    (r"rtx 3090", Peak("RTX 3090", 35.6, 35.6, 71.0, 71.0)),
)

KINDS = ("fp32", "tf32", "bf16", "fp16")


def compute_kind(precision: str, device: torch.device) -> str:
    """The arithmetic a run's matmuls use: ``bf16``/``fp16`` under mixed precision; under
    ``32``, ``tf32`` on CUDA where float32 matmuls are allowed TF32 (``trainer.tf32``, Ampere
    and newer), else ``fp32``."""
    if precision == "bf16-mixed":
        return "bf16"
    if precision == "16-mixed":
        return "fp16"
    if (device.type == "cuda" and torch.get_float32_matmul_precision() != "highest"
            and torch.cuda.get_device_capability(device)[0] >= 8):
        return "tf32"
    return "fp32"


def datasheet_peak(device_name: str, kind: str) -> tuple[float, str] | None:
    """``(TFLOP/s, "H100 SXM bf16")`` for a card named ``device_name`` (as
    ``torch.cuda.get_device_name`` says it) computing in ``kind``; None where the table has none.

    Example:
        >>> datasheet_peak("NVIDIA H100 80GB HBM3", "bf16")
        (989.5, 'H100 SXM bf16')
    """
    name = device_name.lower()
    for pattern, peak in GPUS:
        if re.search(pattern, name):
            value = getattr(peak, kind)
            return None if value is None else (float(value), f"{peak.name} {kind}")
    return None


def machine_key(device: torch.device, kind: str) -> str:
    """The key of a measured peak: host, processor or GPU, precision and CPU thread count."""
    what = (torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name())
    return f"{platform.node()}|{device.type}: {what}|{kind}|{torch.get_num_threads()} threads"


def best_known(key: str, measured: float) -> float:
    """The larger of ``measured`` and the best figure kept for ``key``; kept in the cache file
    when it is larger (a cache that cannot be written: the measurement alone)."""
    path = _cache_dir() / "peaks.json"
    try:
        known = json.loads(path.read_text())
        known = known if isinstance(known, dict) else {}
    except (OSError, ValueError):
        known = {}
    best = known.get(key)
    if isinstance(best, (int, float)) and best >= measured:
        return float(best)
    known[key] = measured
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".peaks-")
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(known, out, indent=1, sort_keys=True)
            os.replace(tmp, path)  # whole or not at all, whoever writes at the same time
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return measured


def _cache_dir() -> Path:
    """Where trainkit keeps what it remembers between runs (as the data checksums do)."""
    if os.environ.get("TRAINKIT_CACHE_DIR"):
        return Path(os.environ["TRAINKIT_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainkit"


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()
