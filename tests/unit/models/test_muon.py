"""optim=muon: which parameters Muon takes, and MuonAdamW as one torch optimizer (the same
updates as torch's Muon and AdamW side by side, LR schedulers, a bitwise state_dict resume)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from trainkit.core.errors import LINE_LIMIT, ConfigError
from trainkit.core.schedules import advance, one_cycle, wsd
from trainkit.models import GPT
from trainkit.models.muon import MuonAdamW, hidden_matrices, split_groups
from trainkit.models.param_groups import build_optimizer, param_groups

NODE = {"lr": 0.01, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw", "fused": True}


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=32, block=8, dim=16, layers=2, heads=2)


def _muon(model: nn.Module, **node: object) -> MuonAdamW:
    options = {**NODE, "decay_norm_and_bias": False, "adamw_params": [], **node}
    return build_optimizer(model, options, lambda n, groups: MuonAdamW(groups, **n))


def _train(model: GPT, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
           steps: int, scheduler: object = None, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 32, (4, 8), generator=g)
        model(ids).logsumexp(-1).mean().backward()
        for each in optimizer if isinstance(optimizer, list) else [optimizer]:
            each.step()
            each.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()


def test_muon_takes_the_hidden_matrices_only() -> None:
    model = _gpt()
    hidden = hidden_matrices(model)
    assert hidden == [f"blocks.{i}.{name}.weight" for i in range(2)
                      for name in ("qkv", "proj", "mlp.0", "mlp.2")]
    # the token embedding (also the tied output layer), positions, norms and biases are AdamW's
    assert not {"tokens.weight", "positions.weight", "ln.weight"} & set(hidden)
    assert hidden_matrices(model, ["blocks.1.*"]) == hidden[:4]


def test_an_output_layer_by_name_stays_on_adamw_and_bad_patterns_are_refused() -> None:
    model = nn.Sequential()
    model.add_module("body", nn.Linear(4, 8))
    model.add_module("fc", nn.Linear(8, 3))
    assert hidden_matrices(model) == ["body.weight"]
    with pytest.raises(ConfigError, match=r"optim.adamw_params: 'nope\*' matches no parameter"):
        hidden_matrices(model, ["nope*"])
    with pytest.raises(ConfigError, match=r"has no 2-D hidden weight for Muon"):
        split_groups(model, param_groups(model), ["body.*"])


def test_groups_split_into_muon_then_adamw_with_their_options() -> None:
    optimizer = _muon(_gpt())
    assert [(g["name"], len(g["params"]), g["weight_decay"]) for g in optimizer.param_groups] \
        == [("default.muon", 8, 0.1), ("no_decay.adamw", 20, 0.0)]
    muon, adamw = optimizer.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert muon.param_groups[0] is optimizer.param_groups[0]
    assert adamw.param_groups[0] is optimizer.param_groups[1]
    assert adamw.param_groups[0]["fused"] and adamw.param_groups[0]["lr"] == 0.01


def test_one_step_is_torchs_muon_and_adamw_side_by_side() -> None:
    ours, theirs = _gpt(), _gpt()
    _train(ours, _muon(ours), 3)
    hidden = set(hidden_matrices(theirs))
    muon = [p for n, p in theirs.named_parameters() if n in hidden]
    rest = [{"params": [p for p in g["params"] if all(p is not q for q in muon)],
             "weight_decay": g.get("weight_decay", 0.1)}
            for g in param_groups(theirs, decay_norm_and_bias=False)]
    _train(theirs, [torch.optim.Muon(muon, lr=0.01, weight_decay=0.1,
                                     adjust_lr_fn="match_rms_adamw"),
                    torch.optim.AdamW([g for g in rest if g["params"]], lr=0.01,
                                      betas=(0.9, 0.95), weight_decay=0.1, fused=True)], 3)
    for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name


def test_a_scheduler_sets_both_optimizers_lr() -> None:
    optimizer = _muon(_gpt())
    scheduler = wsd(optimizer, 10, warmup_steps=2, decay_fraction=0.5)
    advance(scheduler, 9)
    lrs = [g["lr"] for opt in optimizer.optimizers for g in opt.param_groups]
    assert lrs == [optimizer.param_groups[0]["lr"]] * 2 and 0 < lrs[0] < 0.01


def test_one_cycle_runs_on_it_and_leaves_both_momenta_alone() -> None:
    optimizer = _muon(_gpt())
    scheduler = one_cycle(optimizer, 10)  # torch's OneCycleLR would need betas in every group
    advance(scheduler, 3)
    muon, adamw = optimizer.param_groups
    assert muon["lr"] == adamw["lr"] > 0.005  # warmed up from 0.01 / 25, both
    assert (muon["momentum"], adamw["betas"]) == (0.95, (0.9, 0.95))


def test_a_state_dict_resume_is_bitwise() -> None:
    model = _gpt()
    optimizer = _muon(model)
    scheduler = wsd(optimizer, 10, warmup_steps=2, decay_fraction=0.5)
    _train(model, optimizer, 3, scheduler)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict()}, buffer)
    _train(model, optimizer, 4, scheduler, seed=2)
    straight = copy.deepcopy(model.state_dict())

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    model = _gpt()
    optimizer = _muon(model)
    scheduler = wsd(optimizer, 10, warmup_steps=2, decay_fraction=0.5)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    assert optimizer.optimizers[1].state is optimizer.state  # re-linked after the load
    assert optimizer.optimizers[0].param_groups[0] is optimizer.param_groups[0]
    _train(model, optimizer, 4, scheduler, seed=2)
    for name, value in straight.items():
        assert torch.equal(model.state_dict()[name], value), name


def test_groups_without_the_muon_key_are_refused() -> None:
    with pytest.raises(ConfigError, match="every param group needs a 'muon' key"):
        MuonAdamW([{"params": [nn.Parameter(torch.zeros(2, 2))]}])


def _tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=8, n_embd=16, n_layer=2,
                                      n_head=2, bos_token_id=0, eos_token_id=0))


def test_gpt2s_conv1d_matrices_go_to_muon_its_tied_embeddings_to_adamw() -> None:
    model = _tiny_gpt2()  # lm_head tied to wte; c_attn, c_proj, c_fc: Conv1D, weight (in, out)
    optimizer = _muon(model)
    muon, adamw = optimizer.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)].split(".", 3)[-1] for p in muon["params"]) == sorted(
        ["attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"] * 2)
    assert "transformer.wte.weight" in {names[id(p)] for p in adamw["params"]}
    assert model.transformer.h[0].mlp.c_fc.weight.shape == (16, 64)  # (in, out)


@pytest.mark.parametrize("fn", [None, "original", "spectral_unclamped"])
def test_a_scale_that_reads_out_by_in_is_refused_for_conv1d_matrices(fn: str | None) -> None:
    with pytest.raises(ConfigError, match=r"'s transformer\.h\.0\.attn\.c_attn\.weight is "
                                          r"\(in, out\) \(a Conv1D\): set optim\.adjust_lr_fn"
                                          "=match_rms_adamw") as refused:
        _muon(_tiny_gpt2(), adjust_lr_fn=fn)
    assert len(f"trainkit: {refused.value}") <= LINE_LIMIT
    try:
        torch.optim.Muon([torch.nn.Parameter(torch.zeros(2, 2))], adjust_lr_fn=fn)
    except ValueError:  # torch 2.11's Muon has original and match_rms_adamw only
        return
    _muon(_gpt(), adjust_lr_fn=fn)  # nn.Linear stores (out, in): as torch's Muon reads it
