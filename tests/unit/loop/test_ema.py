"""EMA of weights: the update rule, evaluation with averaged weights, and its checkpointed state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainkit.core.errors import TrainkitError
from trainkit.loop.ema import EMA


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def test_update_follows_the_warmed_up_decay() -> None:
    model = _model()
    ema = EMA(model, decay=0.9)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    for n in range(1, 30):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        model(torch.randn(5, 4))  # moves batch-norm statistics and its integer counter
        ema.update()
        decay = min(0.9, (1 + n) / (10 + n))
        for key, value in model.state_dict().items():
            if value.is_floating_point():
                expected[key] = decay * expected[key] + (1 - decay) * value
            else:
                expected[key] = value.clone()
    averaged = ema.state_dict()["weights"]
    for key, value in expected.items():
        torch.testing.assert_close(averaged[key], value)
    assert averaged["1.num_batches_tracked"] == 29


def test_applied_swaps_weights_in_and_back() -> None:
    model = _model()
    ema = EMA(model, decay=0.5)
    own = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)
    ema.update()
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    with ema.applied():
        inside = {k: v.clone() for k, v in model.state_dict().items()}
    for key in own:
        torch.testing.assert_close(inside[key], ema.state_dict()["weights"][key])
        torch.testing.assert_close(model.state_dict()[key], trained[key])
    assert not torch.equal(inside["0.weight"], trained["0.weight"])


def test_state_round_trips_and_rejects_another_model() -> None:
    model = _model()
    ema = EMA(model, decay=0.99)
    for _ in range(3):
        with torch.no_grad():
            model[0].weight.add_(1)
        ema.update()
    restored = EMA(_model(), decay=0.99)
    restored.load_state_dict(ema.state_dict())
    assert restored.updates == 3
    for a, b in zip(restored.shadow, ema.shadow):
        assert torch.equal(a, b)
    with pytest.raises(TrainkitError, match="EMA weights do not match"):
        EMA(nn.Linear(4, 2)).load_state_dict(ema.state_dict())


def test_decay_out_of_range() -> None:
    with pytest.raises(TrainkitError, match="decay"):
        EMA(_model(), decay=1.0)
