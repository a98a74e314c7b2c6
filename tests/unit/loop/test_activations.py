from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from trainkit.core.errors import ConfigError
from trainkit.loop.activations import apply_activation_checkpointing
from trainkit.models.mnist import MnistNet


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


def test_a_selector_matching_nothing_is_an_error_listing_what_the_model_has() -> None:
    with pytest.raises(ConfigError, match="match nothing") as raised:
        apply_activation_checkpointing(_model(), ["Blok"])
    message = str(raised.value)
    assert "classes: Block, Linear, Dropout" in message and "paths: 0, 1, 2, 3" in message
    with pytest.raises(ConfigError) as raised:  # the README's old example, on a shipped model
        apply_activation_checkpointing(MnistNet(), ["Block"])
    message = str(raised.value)
    assert len(message) <= 200 and "\n" not in message
    assert "paths: features, head" in message and "Conv2d" in message
    assert message.count("Block") == 1  # named as the culprit, never suggested


def test_what_was_wrapped_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="trainkit"):
        apply_activation_checkpointing(MnistNet(), ["Conv2d"])
    assert caplog.messages == ["activation checkpointing: 2 modules recomputed in backward: "
                               "Conv2d x2 (features.1, features.5)"]


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


def test_compiled_and_eager_checkpointing_update_batch_norm_statistics_once() -> None:
    # Under torch.compile a context_fn that is not a pair of TorchDispatchModes is refused (it
    # crashed the first step); the compiled graph applies buffer updates once by itself.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 8), nn.Sequential(nn.BatchNorm1d(8), nn.ReLU()),
                          nn.Linear(8, 2))
    eager, compiled = copy.deepcopy(plain), copy.deepcopy(plain)
    for model in (eager, compiled):
        assert apply_activation_checkpointing(model, ["1"]) == ["1"]
    x = torch.randn(16, 6)
    for model in (plain, eager, torch.compile(compiled)):
        for _ in range(2):  # two steps: running statistics moved twice, not four times
            model(x).square().mean().backward()
    assert int(compiled[1][0].num_batches_tracked) == 2
    for model in (eager, compiled):
        for (name, a), b in zip(plain.state_dict().items(), model.state_dict().values()):
            torch.testing.assert_close(a, b, msg=name)
        for a, b in zip(plain.parameters(), model.parameters()):
            torch.testing.assert_close(a.grad, b.grad)
