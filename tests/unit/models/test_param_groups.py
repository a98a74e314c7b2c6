"""Freezing and parameter groups for any module: glob patterns, timm's layer decay, no decay on
biases/norms/embeddings, the first log line, and gradual unfreezing that resumes exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from trainkit import CheckpointConfig, Trainer, TrainerConfig, seed_everything
from trainkit.core.errors import ConfigError
from trainkit.core.schedules import one_cycle, schedule_words, warmup_cosine
from trainkit.data import InMemoryLoader
from trainkit.data.sources.tensors import TensorData
from trainkit.models import GPT
from trainkit.models.param_groups import (
    apply_freeze,
    build_optimizer,
    describe,
    layer_ids,
    param_groups,
)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.LayerNorm(8), nn.Linear(8, 3))


def _names(group: dict, model: nn.Module) -> list[str]:
    ids = {id(p): n for n, p in model.named_parameters()}
    return [ids[id(p)] for p in group["params"]]


def test_the_first_matching_group_wins_and_the_rest_keep_the_optimizers_settings() -> None:
    model = _net()
    groups = param_groups(model, groups=[{"params": "3.*", "lr": 0.1, "name": "head"},
                                         {"params": ["1.*", "3.weight"], "lr": 0.01}])
    assert [(g["name"], _names(g, model), g.get("lr")) for g in groups] == [
        ("group1", ["1.weight", "1.bias"], 0.01), ("default", ["2.weight", "2.bias"], None),
        ("head", ["3.weight", "3.bias"], 0.1)]
    optimizer = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.05)
    assert optimizer.param_groups[1]["lr"] == 1e-3
    assert describe(model, optimizer) == (
        "179 parameters; 3 groups: group1 lr 0.01 wd 0.05, default lr 0.001 wd 0.05, head lr "
        "0.1 wd 0.05")


def test_layer_decay_gives_timms_scales_for_a_timm_vit() -> None:
    timm = pytest.importorskip("timm")  # here, not at collection: ~1 s of every worker's start
    from timm.optim import param_groups_layer_decay

    model = timm.create_model("vit_tiny_patch16_224", depth=3, num_classes=5)
    ours = param_groups(model, lr=1.0, layer_decay=0.5)
    theirs = param_groups_layer_decay(model, weight_decay=0.0, layer_decay=0.5)
    scale = {id(p): g["lr"] for g in ours for p in g["params"]}
    assert {id(p): g["lr_scale"] for g in theirs for p in g["params"]} == scale
    assert sorted(set(scale.values())) == [0.0625, 0.125, 0.25, 0.5, 1.0]  # stem, 3 blocks, head


def test_layer_ids_of_a_gpt_and_through_a_wrapper() -> None:
    ids = layer_ids(nn.ModuleDict({"inner": GPT(layers=2, dim=16, heads=2)}))
    assert (ids["inner.tokens.weight"], ids["inner.blocks.0.qkv.weight"],
            ids["inner.blocks.1.proj.bias"], ids["inner.ln.weight"]) == (0, 1, 2, 3)
    with pytest.raises(ConfigError, match="no layer numbering for Sequential"):
        layer_ids(_net())


def test_no_decay_on_biases_norms_and_embeddings_of_a_gpt() -> None:
    model = GPT(layers=1, dim=16, heads=2)
    groups = param_groups(model, decay_norm_and_bias=False)
    undecayed = next(g for g in groups if g.get("weight_decay") == 0.0)
    assert sorted(_names(undecayed, model)) == sorted(
        n for n, p in model.named_parameters() if p.ndim == 1 or n.startswith(("tokens",
                                                                              "positions")))
    decayed = next(g for g in groups if "weight_decay" not in g)
    assert sorted(_names(decayed, model)) == ["blocks.0.mlp.0.weight", "blocks.0.mlp.2.weight",
                                              "blocks.0.proj.weight", "blocks.0.qkv.weight"]


def test_config_mistakes_are_one_line() -> None:
    model = _net()
    make = lambda node, groups: torch.optim.SGD(groups, lr=node["lr"])  # noqa: E731
    with pytest.raises(ConfigError, match=r"optim.param_groups: betas is not an option of SGD"):
        build_optimizer(model, {"lr": 0.1, "param_groups": [{"params": "1.*", "betas": 1}]},
                        make)
    with pytest.raises(ConfigError, match=r"optim.param_groups\[0\]: 'fc.\*' matches no "
                                          r"parameter of Sequential \(names look like 1.weight"):
        build_optimizer(model, {"lr": 0.1, "param_groups": [{"params": "fc.*"}]}, make)
    with pytest.raises(ConfigError, match=r"trainer.freeze: 'body.*' matches no parameter"):
        apply_freeze(model, TrainerConfig(freeze=["body.*"]), 0)
    with pytest.raises(ConfigError, match=r"trainer.unfreeze_at_epoch runs in one process only"):
        apply_freeze(model, TrainerConfig(freeze=["1.*"], unfreeze_at_epoch=1), 0, world_size=2)
    with pytest.raises(ConfigError, match=r"trainer.unfreeze_at_epoch needs trainer.freeze"):
        TrainerConfig(unfreeze_at_epoch=1)


def _loader() -> InMemoryLoader:
    g = torch.Generator().manual_seed(3)
    data = TensorData(torch.randint(0, 255, (48, 1, 4, 4), dtype=torch.uint8, generator=g),
                      torch.randint(0, 3, (48,), generator=g), (0.5,), (0.25,), 3)
    return InMemoryLoader(data, 8, shuffle=True, seed=0)


def _fit(run_dir: Path, stop_at: int | None = None) -> tuple[nn.Module, dict]:
    seed_everything(0)
    model = _net()
    optimizer = torch.optim.AdamW(param_groups(model, decay_norm_and_bias=False), lr=0.01)
    config = TrainerConfig(device="cpu", max_epochs=3, log_every_n_steps=1, freeze=["1.*"],
                           unfreeze_at_epoch=1)
    trainer = Trainer(config, run_dir=run_dir, checkpoint=CheckpointConfig())
    return model, trainer.fit(model, optimizer, _loader(), stop_at_step=stop_at)


def test_gradual_unfreezing_trains_the_frozen_from_its_epoch_and_resumes_exactly_across_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = _net()[1].weight.detach().clone()
    _, stopped = _fit(tmp_path / "run", stop_at=6)  # the last step of epoch 1: frozen
    assert stopped["status"] == "preempted"
    saved = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert torch.equal(saved["model"]["1.weight"], first)
    assert "179 parameters: 43 train, 136 frozen; 2 groups" in capsys.readouterr().out
    resumed, summary = _fit(tmp_path / "run")  # resumes into epoch 2: unfrozen
    assert summary["global_step"] == 18
    assert ("epoch 2: 2 parameter tensors (136) unfrozen (trainer.unfreeze_at_epoch=1)"
            in capsys.readouterr().out)
    straight, _ = _fit(tmp_path / "straight")
    assert not torch.equal(straight[1].weight, first)
    for (name, p), q in zip(resumed.named_parameters(), straight.parameters()):
        assert torch.equal(p, q), name


def test_the_first_line_shows_the_configured_peak_lrs_and_the_schedule_in_words() -> None:
    """Issue 61, fault 3: a warm-up's first LR (1e-3 / 20 = 5e-05) is not what the line says."""
    model = _net()
    groups = param_groups(model, groups=[{"params": "3.*", "lr": 1e-2, "name": "head"}])
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    scheduler = warmup_cosine(optimizer, 100, warmup_steps=20)
    assert max(g["lr"] for g in optimizer.param_groups) == pytest.approx(5e-04)
    text = describe(model, optimizer, schedule_words(scheduler))
    assert text.endswith("2 groups: default lr 0.001 wd 0.01, head lr 0.01 wd 0.01; linear "
                         "warm-up to lr over 20 steps, then cosine to 0 over 80 steps"), text
    single = torch.optim.AdamW(model.parameters(), lr=2e-3)
    words = schedule_words(one_cycle(single, 100, pct_start=0.25))
    assert describe(model, single, words) == (
        "179 parameters; peak lr 0.002; one-cycle schedule: up from lr/25 over 25 of 100 steps, "
        "then cosine down to lr/250000")
