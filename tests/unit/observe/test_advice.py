"""The Advisor's rules on real window figures: when a finding is said, and that it is said once."""

from __future__ import annotations

import psutil
import torch

from trainkit.core.device import GIB
from trainkit.data import InMemoryLoader, make_loader
from trainkit.data.sources.tensors import TensorData
from trainkit.observe.advice import PREFIX, Advisor, input_hint

CPU = torch.device("cpu")


def window(wait_pct: float, rss_gib: float = 0.5) -> dict[str, float]:
    return {"time/data_wait_pct": wait_pct, "memory/cpu_rss_gib": rss_gib}


def test_waiting_is_said_after_three_waiting_windows_in_a_row_and_only_once() -> None:
    advisor = Advisor(CPU, [])
    said = [advisor.window(window(w), step) for step, w in
            enumerate([90, 90, 90, 10, 80, 70, 60, 95, 95], start=1)]
    # the first window (start-up) does not count; 90, 90 then 10 starts over; 80, 70, 60 say it
    assert [len(lines) for lines in said] == [0, 0, 0, 0, 0, 0, 1, 0, 0]
    line = said[6][0]
    assert line.startswith(PREFIX + "input-bound: the step waited for data 70% ")
    assert "(to step 7)" in line
    assert advisor.lines == [line.removeprefix(PREFIX)]


def test_a_short_wait_is_not_said() -> None:
    advisor = Advisor(CPU, [])
    assert not any(advisor.window(window(29), step) for step in range(10))
    assert advisor.lines == []


def test_memory_near_the_machines_ram_is_said_once() -> None:
    total = psutil.virtual_memory().total / GIB
    advisor = Advisor(CPU, [])
    assert advisor.window(window(0, rss_gib=0.5 * total), 1) == []
    lines = advisor.window(window(0, rss_gib=0.97 * total), 2)
    assert len(lines) == 1 and "memory: resident memory" in lines[0] and "97%" in lines[0]
    assert advisor.window(window(0, rss_gib=0.99 * total), 3) == []


def test_the_hint_names_the_setting_of_the_loader_in_use() -> None:
    data = TensorData(torch.zeros(16, 1, 4, 4, dtype=torch.uint8), torch.zeros(16).long(),
                      (0.5,), (0.25,), 2)
    samples = torch.utils.data.TensorDataset(data.images, data.labels)
    assert input_hint(make_loader(samples, 4, shuffle=False, num_workers=1)).startswith(
        "data.num_workers=2 (now 1), or data.loader=memory")
    assert input_hint(make_loader(samples, 4, shuffle=False, num_workers=0)).startswith(
        "data.num_workers=2 (now 0)")
    assert "data.batch_size" in input_hint(InMemoryLoader(data, 4, shuffle=False, device=CPU))
    assert "num_workers" in input_hint([(data.images, data.labels)])
