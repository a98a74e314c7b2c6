"""``trainer.compile=regional``: each repeated block compiled once, the losses of eager mode.

Inductor's code generation takes a minute on a loaded 2-core machine, so the blocks compile
with the ``aot_eager`` backend (``Module.compile``'s backend swapped): dynamo's tracing, its
reuse of one graph for every block and AOTAutograd's forward/backward graphs (the selective
checkpoint contexts included) are all exercised; the kernels are eager ones.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo.utils
from torch import nn

from trainkit import Trainer, TrainerConfig, load_checkpoint
from trainkit.core.errors import ConfigError
from trainkit.distributed import strategy
from trainkit.models.gpt import GPT, lm_forward, lm_loss

STEPS = 6


def _fit(run_dir: Path, **overrides: Any) -> tuple[dict[str, Any], list[float], GPT]:
    torch.manual_seed(0)
    model = GPT(vocab_size=64, block=16, dim=32, layers=3, heads=2)
    g = torch.Generator().manual_seed(1)
    data = [{"tokens": torch.randint(0, 64, (4, 17), generator=g)} for _ in range(STEPS)]
    config = TrainerConfig(device="cpu", max_steps=STEPS, log_every_n_steps=1, **overrides)
    summary = Trainer(config, run_dir=run_dir).fit(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), data, criterion=lm_loss,
        forward=lm_forward)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    losses = [row["train/loss"] for row in map(json.loads, lines) if "train/loss" in row]
    return summary, losses, model


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An eager fit, and one with regional compilation and selective checkpointing together."""
    eager = _fit(tmp_path_factory.mktemp("eager"))
    original = nn.Module.compile
    torch._dynamo.utils.counters.clear()
    run_dir = tmp_path_factory.mktemp("regional")
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(nn.Module, "compile", lambda self, **kw: original(
                self, backend="aot_eager", **kw))
            regional = _fit(run_dir, compile="regional", activation_checkpointing="selective")
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    return {"eager": eager, "regional": regional, "run_dir": run_dir, "graphs": graphs,
            "log": (run_dir / "train.log").read_text()}


def test_regional_trains_the_losses_of_eager_with_one_graph_for_all_blocks(
        runs: dict[str, Any]) -> None:
    (_, eager, _), (summary, regional, model) = runs["eager"], runs["regional"]
    assert len(eager) == len(regional) == STEPS
    assert regional == pytest.approx(eager, rel=1e-4)
    assert runs["graphs"] == 1  # three Blocks, one class: traced and compiled once
    assert ("compile: regional, 3 blocks (Block x3: blocks.0, blocks.1, blocks.2), blocks alike "
            "share one compiled graph; the rest eager\n") in runs["log"]
    assert "activation checkpointing (selective: " in runs["log"]
    assert summary["first_step_s"] > summary["steady_step_s"] > 0  # the first step compiled
    assert (f"compile=regional: first step {summary['first_step_s']:.1f} s (cold start: "
            f"compiling), steady steps {1000 * summary['steady_step_s']:.1f} ms") in runs["log"]
    saved = load_checkpoint(runs["run_dir"] / "checkpoints" / "last.pt")["model"]
    assert list(saved) == list(model.state_dict()) == list(runs["eager"][2].state_dict())


def test_a_model_without_repeated_blocks_is_compiled_whole(
        caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))  # repeated, one layer
    with caplog.at_level(logging.INFO, logger="trainkit"):
        compiled = strategy.compiled(model, "regional")
    assert compiled is not model  # torch.compile's wrapper: nothing ran, nothing compiled yet
    assert caplog.messages == ["compile=regional: Sequential has no repeated block of several "
                               "layers", "compile: the whole model (torch.compile)"]


@pytest.mark.parametrize(("value", "expected"), [(True, True), ("true", True), (False, False),
                                                 ("regional", "regional")])
def test_the_compile_key_takes_true_false_or_regional(value: object, expected: object) -> None:
    assert TrainerConfig(compile=value).compile is expected


def test_the_compile_key_refuses_anything_else_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^trainer.compile='regonal': use false, true"):
        TrainerConfig(compile="regonal")
