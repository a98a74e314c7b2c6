from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from trainkit.activations import apply_activation_checkpointing
from trainkit.errors import ConfigError


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.fc(x)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), Block(), nn.Linear(16, 2))


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(1)  # the same dropout masks on both sides
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_checkpointed_blocks_give_identical_gradients() -> None:
    x = torch.randn(8, 16)
    plain, wrapped = _model(), _model()
    names = apply_activation_checkpointing(wrapped, ["Block"])
    assert names == ["0", "1", "2"]
    for a, b in zip(_grads(plain, x), _grads(wrapped, x)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert plain.state_dict().keys() == wrapped.state_dict().keys()


def test_select_by_module_path_and_under_bf16_autocast() -> None:
    x = torch.randn(8, 16)
    plain, wrapped = _model(), _model()
    assert apply_activation_checkpointing(wrapped, ["1"]) == ["1"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = _grads(plain, x), _grads(wrapped, x)
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b)


def test_a_selector_matching_nothing_is_an_error() -> None:
    with pytest.raises(ConfigError, match="match no module"):
        apply_activation_checkpointing(_model(), ["Blok"])


def test_recomputation_leaves_batch_norm_statistics_as_one_forward_does() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped, ["BatchNorm1d"])
    x = torch.randn(16, 6)
    for model in (plain, wrapped):
        model(x).square().mean().backward()
    for (name, a), b in zip(plain.state_dict().items(), wrapped.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(plain.parameters(), wrapped.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
