"""trainer.profile: a Chrome trace of the scheduled steps, read back, and the top operators in
train.log; off, no callback at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from trainkit import Trainer, TrainerConfig
from trainkit.config import ProfileConfig
from trainkit.core.errors import ConfigError
from trainkit.observe.profile import MemoryHistory, Profiler


def _batches(n: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(n)]


def test_a_trace_of_the_active_steps_holds_their_operators(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    profile = {"enabled": True, "wait": 1, "warmup": 1, "active": 2, "repeat": 1, "top_ops": 3}
    trainer = Trainer(TrainerConfig(device="cpu", profile=profile), run_dir=tmp_path)
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches())
    traces = sorted((tmp_path / "profile" / "rank0").glob("trace_step*.json"))
    assert [t.name for t in traces] == ["trace_step4.json"]  # steps 3 and 4 recorded
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"aten::addmm", "aten::relu"} <= names  # the model's forward
    assert any(str(n).startswith("Optimizer.step#SGD") for n in names)  # and its step
    assert sum(str(n).startswith("ProfilerStep#") for n in names) == 2
    log = (tmp_path / "train.log").read_text()
    lines = [line for line in log.splitlines() if "profile rank 0 to step 4: " in line]
    assert len(lines) == 3 and all(" ms (" in line and " calls" in line for line in lines)


def test_off_adds_no_callback(tmp_path: Path) -> None:
    trainer = Trainer(TrainerConfig(device="cpu"), run_dir=tmp_path)
    assert trainer.callbacks.handlers["on_step_end"] == ()
    other_rank = Trainer(TrainerConfig(device="cpu", profile={"enabled": True, "ranks": [1]}),
                         run_dir=tmp_path)
    assert other_rank.callbacks.handlers["on_step_end"] == ()


@pytest.mark.parametrize(("key", "value"), [("active", 0), ("ranks", ["0"]), ("wait", -1)])
def test_a_bad_schedule_is_one_line(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"trainer.profile.{key}"):
        ProfileConfig(**{key: value})


def test_memory_history_is_recorded_with_python_stacks_in_the_active_steps_only(
        tmp_path: Path) -> None:
    """What the profiler asks torch.cuda.memory._record_memory_history and _dump_snapshot
    for (their stand-ins here, through MemoryHistory's seam), step by step: Python stacks
    during the window's two active steps, off before and after, and a snapshot at the window's
    end and at an out-of-memory error after it."""
    events: list[tuple] = []
    memory = MemoryHistory(record=lambda **kwargs: events.append(("record", kwargs)),
                           dump=lambda path: events.append(("dump", Path(path).name)))
    config = ProfileConfig(enabled=True, wait=1, warmup=1, active=2, repeat=1, top_ops=0,
                           memory_snapshot=True)
    profiler = Profiler(config, tmp_path, 0, torch.device("cpu"), memory=memory)
    profiler.on_fit_start(None)
    for step in range(1, 7):
        events.append(("step", step))
        profiler.on_step_end(None, step)
    profiler.out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    profiler.close()
    on = {"enabled": "all", "context": "all", "stacks": "python", "max_entries": 100_000}
    assert events == [("step", 1), ("step", 2), ("record", on), ("step", 3), ("step", 4),
                      ("dump", "memory_step4.pickle"), ("record", {"enabled": None}),
                      ("step", 5), ("step", 6), ("dump", "oom_rank0.pickle")]
