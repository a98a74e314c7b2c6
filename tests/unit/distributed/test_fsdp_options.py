"""FSDP combined with other options, in one process (a 1-rank mesh), and the errors it gives.

channels_last (on the inputs only under FSDP), mixed precision with batch-norm (norm layers in
float32 units of their own), a module ``fully_shard`` refuses (one line naming the option), and
the entry point's rule for "lost contact with another rank" (only for a real lost peer).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.helpers.fakes import write_fake_mnist
from trainkit import (
    InMemoryLoader,
    Runtime,
    Trainer,
    TrainerConfig,
    TrainkitError,
    load_mnist,
    seed_everything,
)
from trainkit.distributed import fsdp
from trainkit.entry.errors import _from_collective, errors_as_one_line
from trainkit.models import CifarNet, MnistNet


@pytest.fixture(autouse=True)
def _no_group_left() -> Iterator[None]:
    yield
    if dist.is_initialized():  # the 1-rank group shard_model joined
        dist.destroy_process_group()


def test_the_norm_layers_kept_in_float32_are_the_batch_norms() -> None:
    assert fsdp.float32_norms(MnistNet()) == ["features.3", "features.7", "features.11"]
    assert fsdp.float32_norms(CifarNet()) == [f"features.{i}" for i in (1, 5, 8, 12, 15, 19, 22)]
    # a LayerNorm has no running statistics: it autocasts as any layer does
    layers = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.BatchNorm1d(4))
    assert fsdp.float32_norms(layers) == ["2"]
    assert fsdp.float32_norms(layers, blocks=["2"]) == []  # a named block keeps its own policy


def test_fsdp_with_channels_last_and_bf16_trains_a_batch_norm_net(tmp_path: Path) -> None:
    """+exp=mnist's settings (channels_last) with bf16-mixed, sharded on one rank: it trains,
    the weights stay contiguous, the norms are float32 units, and one line says so."""
    root = write_fake_mnist(tmp_path / "data", n_train=64, n_test=32)
    seed_everything(0)
    model = MnistNet(widths=(4, 8, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train, val = (InMemoryLoader(load_mnist(root, train=t, verify=False, download=False), 32,
                                 shuffle=t, channels_last=True) for t in (True, False))
    config = TrainerConfig(device="cpu", strategy="fsdp", precision="bf16-mixed",
                           channels_last=True, log_every_n_steps=1)
    summary = Trainer(config, run_dir=tmp_path / "run").fit(model, optimizer, train,
                                                            val_data=val)
    assert summary["status"] == "completed" and summary["global_step"] == 2
    assert (tmp_path / "run" / "summary.json").is_file()
    lines = (tmp_path / "run" / "train.log").read_text().splitlines()
    assert sum(" channels_last: the inputs only (" in line for line in lines) == 1
    assert any("3 norm layers with running statistics kept in float32" in line for line in lines)
    assert all(fsdp.local(p).is_contiguous() for p in model.parameters())
    norm = model.features[3]
    assert fsdp.local(norm.weight).dtype == torch.float32
    assert norm.running_mean.dtype == torch.float32 and int(norm.num_batches_tracked) == 2


class Transposed(nn.Module):
    """A weight that is a transposed view: ``fully_shard`` refuses non-contiguous parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


def test_a_module_fully_shard_refuses_is_one_line_naming_the_option() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Transposed())
    with pytest.raises(TrainkitError) as err:
        fsdp.shard_model(model, None, Runtime.from_env("cpu"))
    message = str(err.value)
    assert message.startswith("trainer.strategy=fsdp: fully_shard refuses Sequential "
                              "(NotImplementedError: FSDP does not support non-contiguous")
    assert message.endswith("; use trainer.strategy=ddp or other trainer.fsdp_blocks")
    assert "\n" not in message and len(message) <= 200
    assert isinstance(err.value.__cause__, NotImplementedError)


def _refusal() -> NotImplementedError:
    """fully_shard's own NotImplementedError, raised from torch.distributed's frames."""
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fully_shard(Transposed())
    except NotImplementedError as err:
        return err
    raise AssertionError("fully_shard took a non-contiguous parameter")


@pytest.mark.parametrize(("make", "lost_peer"), [
    (_refusal, False),
    (lambda: RuntimeError("expected scalar type BFloat16 but found Float"), False),
    (lambda: dist.DistBackendError("NCCL communicator was aborted on rank 1"), True),
    (lambda: dist.DistNetworkError("Connection reset by peer"), True),
    (lambda: dist.DistStoreError("Timed out after 61 seconds waiting for clients. 1/2"), True),
    (lambda: RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer"), True),
])
def test_lost_contact_only_for_a_lost_peer_and_never_in_one_process(
        make, lost_peer: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    err = make()
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _from_collective(err) is lost_peer
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert _from_collective(err) is False
    monkeypatch.delenv("WORLD_SIZE")
    assert _from_collective(err) is False


def test_the_entry_point_folds_only_a_lost_peer_into_lost_contact(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as stop, errors_as_one_line():
        raise dist.DistBackendError("Connection closed by peer [10.0.0.2]:29500")
    assert stop.value.code == 1
    assert capsys.readouterr().err.rstrip().splitlines()[-1] == (
        "trainkit: rank 0: lost contact with another rank, which probably failed; see its "
        "error above")
    with pytest.raises(NotImplementedError), errors_as_one_line():  # a bug: its traceback
        raise _refusal()
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(dist.DistBackendError), errors_as_one_line():  # no peer to lose
        raise dist.DistBackendError("Connection closed by peer")
