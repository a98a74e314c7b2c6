"""trainer.strategy and FSDP in one process: the keys, the default blocks, a 1-rank mesh."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.dist.nets import FlatNet
from trainkit import (
    ConfigError,
    InMemoryLoader,
    Runtime,
    Trainer,
    TrainerConfig,
    load_mnist,
    seed_everything,
)
from trainkit.distributed import fsdp, group


@pytest.mark.parametrize(("strategy", "world", "expected"), [
    ("auto", 1, "none"), ("auto", 2, "ddp"), ("ddp", 1, "none"), ("ddp", 4, "ddp"),
    ("fsdp", 1, "fsdp"), ("fsdp", 2, "fsdp")])
def test_strategy_resolution(strategy: str, world: int, expected: str) -> None:
    assert fsdp.resolve_strategy(strategy, world) == expected


@pytest.mark.parametrize(("key", "value", "message"), [
    ("strategy", "deepspeed", "trainer.strategy='deepspeed' is not one of auto, ddp, fsdp"),
    ("fsdp_blocks", [""], "trainer.fsdp_blocks must be a list of module class names or paths"),
    ("fsdp_reshard_after_forward", "yes", "trainer.fsdp_reshard_after_forward must be true or "
                                          "false, got 'yes'"),
])
def test_bad_fsdp_keys_are_one_line(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(")) as err:
        TrainerConfig(**{key: value})
    assert "\n" not in str(err.value)


class Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Stack(nn.Module):
    """Embedding-like stem, a ModuleList of 3 layers, a head: the layers are the blocks (each
    larger on average than a Linear, of which there are 5 counting the layers' own)."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.stem, self.head = nn.Linear(8, width), nn.Linear(width, 2)
        self.layers = nn.ModuleList(Layer(width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_default_blocks_are_the_largest_repeated_block() -> None:
    assert fsdp.default_blocks(Stack()) == ["layers.0", "layers.1", "layers.2"]
    assert fsdp.default_blocks(FlatNet()) == ["net.1", "net.3"]  # its two Linear layers
    assert fsdp.default_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []  # the root only


def test_fsdp_blocks_naming_nothing_is_one_line_listing_the_model() -> None:
    with pytest.raises(ConfigError) as err:
        fsdp.shard_model(FlatNet(), None, Runtime(torch.device("cpu")), blocks=["Block"])
    assert str(err.value) == ("trainer.fsdp_blocks: ['Block'] match nothing in FlatNet; its "
                              "paths: net; classes: Sequential, Flatten, Linear, ReLU")
    assert not dist.is_initialized()  # checked before any process group is joined


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """fsdp in one process joins a 1-rank group; it is left again after the test."""
    yield
    group.shutdown()


def _fit(root: object, **settings: object) -> dict[str, torch.Tensor]:
    seed_everything(0)
    model = FlatNet().net  # its layers without the fault hooks (which dynamo cannot trace)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = InMemoryLoader(load_mnist(root, train=True, verify=False, download=False), 32,
                          shuffle=True)
    config = TrainerConfig(device="cpu", max_steps=4, accumulate_grad_batches=2,
                           gradient_clip_val=0.5, activation_checkpointing=["1"], **settings)
    Trainer(config).fit(model, optimizer, data)
    return {k: getattr(v, "full_tensor", v.detach)() for k, v in model.state_dict().items()}


def test_fsdp_in_one_process_with_compile_and_checkpointing_trains_like_the_plain_model(
        mnist_root: object, one_rank_group: None) -> None:
    """Activation checkpointing, then fully_shard (1-rank mesh), then torch.compile: the
    weights of the plain model after 4 steps of accumulation and clipping."""
    import torch._dynamo.utils

    plain = _fit(mnist_root)
    torch._dynamo.utils.counters.clear()
    sharded = _fit(mnist_root, strategy="fsdp", compile=True)
    assert dist.is_initialized() and dist.get_world_size() == 1
    # compiled, not silently eager: the root's forward (its Linear units stay eager)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    for name, expected in plain.items():
        torch.testing.assert_close(sharded[name], expected, rtol=1e-5, atol=1e-6, msg=name)


def test_non_finite_losses_skip_the_step_under_fsdp_as_without(one_rank_group: None) -> None:
    def run(strategy: str) -> tuple[dict, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(16, 3))
        g = torch.Generator().manual_seed(0)
        data = [(torch.randn(8, 16, generator=g), torch.randint(0, 3, (8,), generator=g))
                for _ in range(6)]
        for i in (2, 4):
            data[i][0][0, 0] = float("nan")
        summary = Trainer(TrainerConfig(device="cpu", strategy=strategy)).fit(
            model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), data)
        return summary, {k: getattr(v, "full_tensor", v.detach)()
                         for k, v in model.state_dict().items()}

    (plain_summary, plain), (summary, sharded) = run("auto"), run("fsdp")
    assert summary["skipped_steps"] == summary["nonfinite_steps"] == 2
    assert plain_summary["skipped_steps"] == 2
    for name, expected in plain.items():
        torch.testing.assert_close(sharded[name], expected, rtol=0, atol=1e-7, msg=name)
