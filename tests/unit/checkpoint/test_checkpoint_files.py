"""``CheckpointFiles`` for a loop of your own: any dict of state (two models and two optimizers by
name, a step counter) saved and resumed; a file it cannot use is an error naming the missing
keys, never a silent start from step 0 (issue 58 item 6)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import trainkit
from trainkit.checkpoint.files import CheckpointFiles, save_atomic
from trainkit.core.errors import TrainkitError


def _gan(seed: int) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    g, d = nn.Linear(4, 3), nn.Linear(3, 1)
    return g, d, torch.optim.Adam(g.parameters(), 1e-2), torch.optim.SGD(d.parameters(), 0.1,
                                                                           momentum=0.9)


def _train(g: nn.Module, d: nn.Module, opt_g: torch.optim.Optimizer,
           opt_d: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        z = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        opt_d.zero_grad()
        d(g(z).detach()).mean().backward()
        opt_d.step()
        opt_g.zero_grad()
        (-d(g(z)).mean()).backward()
        opt_g.step()


def _state(g, d, opt_g, opt_d, step: int) -> dict:
    return {"g": g.state_dict(), "d": d.state_dict(), "opt_g": opt_g.state_dict(),
            "opt_d": opt_d.state_dict(), "step": step}


def test_a_dict_of_two_models_and_optimizers_resumes_where_it_stopped(tmp_path: Path) -> None:
    straight = _gan(0)
    _train(*straight, range(6))

    first = _gan(0)
    files = CheckpointFiles(tmp_path, keep_last=2, required=("g", "d", "opt_g", "opt_d", "step"))
    assert files.load_latest() is None  # an empty folder: start from scratch
    _train(*first, range(3))
    files.save(_state(*first, 3), step=3)

    again = _gan(1)  # a new process: other random weights until the checkpoint is loaded
    state = CheckpointFiles(tmp_path, required=("g", "d", "opt_g", "opt_d", "step")).load_latest()
    assert state is not None and state["step"] == 3
    g, d, opt_g, opt_d = again
    g.load_state_dict(state["g"])
    d.load_state_dict(state["d"])
    opt_g.load_state_dict(state["opt_g"])
    opt_d.load_state_dict(state["opt_d"])
    _train(*again, range(state["step"], 6))
    for resumed, reference in zip(again[:2], straight[:2], strict=True):
        for a, b in zip(resumed.state_dict().values(), reference.state_dict().values(),
                        strict=True):
            assert torch.equal(a, b)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "step_000000003.pt"]


def test_a_file_without_the_required_keys_is_an_error_naming_them(tmp_path: Path) -> None:
    save_atomic({"model": {}, "global_step": 5}, tmp_path / "last.pt")  # another loop's file
    files = CheckpointFiles(tmp_path, required=("g", "d", "step"))
    with pytest.raises(TrainkitError) as caught:
        files.load_latest()
    message = str(caught.value)
    assert "\n" not in message
    assert "'g', 'd', 'step'" in message and "global_step, model" in message
    # the keys can be asked for at the call too; without any required key, any dict loads
    with pytest.raises(TrainkitError, match="no 'opt_g'"):
        CheckpointFiles(tmp_path).load_latest(required=("opt_g",))
    assert CheckpointFiles(tmp_path).load_latest()["global_step"] == 5


def test_the_old_name_is_an_alias_of_the_new() -> None:
    assert trainkit.CheckpointManager is trainkit.CheckpointFiles is CheckpointFiles
