from __future__ import annotations

import copy
import ctypes
import logging

import pytest
import torch
from torch import nn

from trainkit.config import TrainerConfig
from trainkit.core.errors import ConfigError
from trainkit.core.runtime import Runtime
from trainkit.distributed import fsdp, group
from trainkit.loop.activations import apply_activation_checkpointing, check_sharded
from trainkit.models.gpt import GPT
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
    assert caplog.messages == ["activation checkpointing (full: each block's input kept, the "
                               "rest recomputed in backward): 2 modules: Conv2d x2 (features.1, "
                               "features.5)"]


@pytest.mark.parametrize("selectors", [["BatchNorm1d"], ["selective", "1"]])
def test_recomputation_leaves_batch_norm_statistics_as_one_forward_does(
        selectors: list[str]) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped, selectors)
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


# -- policies: full and selective ----------------------------------------------------------------


def _heap_in_use() -> int:
    """Bytes the C heap has handed out and not freed (glibc's mallinfo2: small blocks plus
    mmapped ones): torch's CPU tensors live there, so a forward's growth is the activation
    memory it holds for backward."""
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_LIBC = ctypes.CDLL(None)
if hasattr(_LIBC, "mallinfo2"):  # glibc 2.33+
    _LIBC.mallinfo2.restype = _Mallinfo2


@pytest.fixture(scope="module")
def policies() -> dict[str, tuple[int, list[torch.Tensor]]]:
    """A tiny GPT trained one step without checkpointing, fully and selectively: the bytes its
    forward held for backward (the second forward's: the first warms the allocator) and the
    gradients."""
    if not hasattr(_LIBC, "mallinfo2"):
        pytest.skip("the heap in use is read with glibc's mallinfo2 (glibc 2.33+)")
    torch.manual_seed(0)
    base, ids = GPT(dim=64, layers=3, heads=2, block=64), torch.randint(0, 256, (16, 64))
    found = {}
    for policy in ("off", "full", "selective"):
        model = copy.deepcopy(base)
        if policy != "off":
            assert apply_activation_checkpointing(model, policy) == ["blocks.0", "blocks.1",
                                                                     "blocks.2"]
        for _ in range(2):
            model.zero_grad()
            before = _heap_in_use()
            loss = model(ids).logsumexp(-1).mean()
            held = _heap_in_use() - before
            loss.backward()
        found[policy] = held, [p.grad.clone() for p in model.parameters()]
        assert model.state_dict().keys() == base.state_dict().keys()
    return found


def test_selective_holds_less_than_off_and_more_than_full(
        policies: dict[str, tuple[int, list[torch.Tensor]]]) -> None:
    off, full, selective = (policies[name][0] for name in ("off", "full", "selective"))
    assert full < selective < 0.85 * off, (off, full, selective)


def test_full_and_selective_give_the_gradients_of_off(
        policies: dict[str, tuple[int, list[torch.Tensor]]]) -> None:
    for policy in ("full", "selective"):
        for a, b in zip(policies["off"][1], policies[policy][1]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_selective_on_chosen_modules_is_logged_with_its_policy(
        caplog: pytest.LogCaptureFixture) -> None:
    x = torch.randn(8, 16)
    plain, wrapped = _model(), _model()
    with caplog.at_level(logging.INFO, logger="trainkit"):
        assert apply_activation_checkpointing(wrapped, ["selective", "1", "2"]) == ["1", "2"]
    assert caplog.messages == ["activation checkpointing (selective: matmul, attention and "
                               "convolution outputs kept, the rest recomputed in backward): "
                               "2 modules: Block x2 (1, 2)"]
    for a, b in zip(_grads(plain, x), _grads(wrapped, x)):  # dropout: the same masks again
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_policy_without_repeated_blocks_or_two_policies_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"selective: Sequential has no repeated block .*"
                                          r"\[selective, <class or path>\]"):
        apply_activation_checkpointing(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), "selective")
    with pytest.raises(ConfigError, match="name two policies"):
        apply_activation_checkpointing(_model(), ["full", "selective", "Block"])


@pytest.mark.parametrize(("value", "expected"), [
    (None, []), (False, []), ("off", []), ([], []), ("selective", ["selective"]),
    ("full", ["full"]), (["Block"], ["Block"]), (["selective", "Block"], ["selective", "Block"]),
])
def test_the_config_key_takes_a_policy_a_list_or_off(value: object, expected: list[str]) -> None:
    assert TrainerConfig(activation_checkpointing=value).activation_checkpointing == expected


@pytest.mark.parametrize("value", [True, 1, ["full", "selective"], [3], "", {"a": 1}])
def test_the_config_key_refuses_anything_else_in_one_line(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^trainer.activation_checkpointing=.*: use full or "
                                          r"selective") as raised:
        TrainerConfig(activation_checkpointing=value)
    assert "\n" not in str(raised.value)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def test_selective_around_fsdp_units_is_refused_and_on_the_units_allowed() -> None:
    """FSDP's gathers inside a selectively checkpointed module run other ops in backward than
    in forward, which the selective replay refuses at the first backward: refused at set-up."""
    runtime = Runtime(torch.device("cpu"))
    try:
        for selectors, refused in ((["selective", "1"], True), ("selective", False)):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 32), nn.Sequential(_Layer(), _Layer()),
                                  nn.Linear(32, 2))
            apply_activation_checkpointing(model, selectors)
            fsdp.shard_model(model, None, runtime)  # the units: the two _Layer blocks
            if refused:
                with pytest.raises(ConfigError, match=r"selective checkpointing of 1 is not "
                                   r"possible under FSDP: it holds FSDP units \(0, 1\)"):
                    check_sharded(model)
            else:
                check_sharded(model)
                model(torch.randn(4, 8)).sum().backward()  # the replay works on the units
    finally:
        group.shutdown()
