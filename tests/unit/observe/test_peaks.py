"""The peak table against the vendors' datasheets, every card and every precision: the dense
figures (a sheet's ``dense | sparse*`` pair gives the first; a sheet giving only the sparse
figure, halved), so a run's MFU is not read against a 2:4-sparsity figure."""

from __future__ import annotations

import pytest

from trainkit.observe.peaks import GPUS, datasheet_peak

# card -> (fp32, tf32, bf16, fp16) dense TFLOP/s, as each sheet prints them
DATASHEETS: dict[str, tuple[float, float | None, float | None, float]] = {
    "H100 PCIe": (51.0, 378.0, 756.5, 756.5),  # H100 sheet: 756*, 1513* (sparse)
    "H100 NVL": (60.0, 417.5, 835.5, 835.5),  # 835*, 1671*
    "GH200": (67.0, 494.5, 989.5, 989.5),  # 989*, 1979*
    "H100 SXM": (67.0, 494.5, 989.5, 989.5),  # 989*, 1979*
    "H200 NVL": (60.0, 417.5, 835.5, 835.5),
    "H200 SXM": (67.0, 494.5, 989.5, 989.5),
    "A100": (19.5, 156.0, 312.0, 312.0),  # 156 | 312*, 312 | 624*
    "L40S": (91.6, 183.0, 362.05, 362.05),  # 183 | 366*, 362.05 | 733*
    "L40": (90.5, 90.5, 181.05, 181.05),  # 90.5 | 181*, 181.05 | 362.1*
    "L4": (30.3, 60.0, 121.0, 121.0),  # 120*, 242*
    "A40": (37.4, 74.8, 149.7, 149.7),  # 74.8 | 149.6*, 149.7 | 299.4*
    "A10/A10G": (31.2, 62.5, 125.0, 125.0),  # 62.5 | 125*, 125 | 250*
    "V100S PCIe": (16.4, None, None, 130.0),
    "V100 PCIe": (14.0, None, None, 112.0),
    "V100 SXM2": (15.7, None, None, 125.0),
    "T4": (8.1, None, None, 65.0),
    "RTX 4090": (82.6, 82.6, 165.2, 165.2),  # Ada whitepaper, FP32 accumulate
    "RTX 3090": (35.6, 35.6, 71.0, 71.0),  # GA102 whitepaper, FP32 accumulate
}


def test_every_card_in_the_table_has_its_datasheets_dense_figures() -> None:
    table = {peak.name: (peak.fp32, peak.tf32, peak.bf16, peak.fp16) for _, peak in GPUS}
    assert table == DATASHEETS


@pytest.mark.parametrize(("device_name", "kind", "expected"), [
    ("NVIDIA L40", "tf32", (90.5, "L40 tf32")),  # was 181: the sparse figure
    ("NVIDIA L40", "bf16", (181.05, "L40 bf16")),
    ("NVIDIA L40S", "tf32", (183.0, "L40S tf32")),
    ("NVIDIA L40S", "bf16", (362.05, "L40S bf16")),
    ("NVIDIA H100 NVL", "bf16", (835.5, "H100 NVL bf16")),
    ("NVIDIA H200 NVL", "tf32", (417.5, "H200 NVL tf32")),
])
def test_a_device_name_finds_its_own_card(device_name: str, kind: str, expected: tuple) -> None:
    assert datasheet_peak(device_name, kind) == expected
