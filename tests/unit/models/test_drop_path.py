"""model.drop_path: the model's own stochastic-depth argument, or one line where it has none."""

from __future__ import annotations

import re

import pytest
from torchvision.ops import StochasticDepth

from trainkit.core.errors import ConfigError
from trainkit.models.build import drop_path_argument, make_model


def test_torchvision_models_take_it_as_stochastic_depth_prob() -> None:
    model = make_model({"_target_": "torchvision.models.convnext_tiny", "num_classes": 3,
                        "drop_path": 0.3})
    assert max(m.p for m in model.modules() if isinstance(m, StochasticDepth)) == 0.3
    grey = {"_target_": "trainkit.models.vision.torchvision_classifier",
            "name": "efficientnet_b0", "in_chans": 1}
    assert drop_path_argument(grey) == "stochastic_depth_prob"


def test_timm_models_take_it_as_drop_path_rate() -> None:
    assert drop_path_argument({"_target_": "timm.create_model"}) == "drop_path_rate"


@pytest.mark.parametrize("target", ["torchvision.models.resnet18",
                                    "torchvision.models.vit_b_16", "trainkit.models.CifarNet"])
def test_a_model_without_it_is_refused(target: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"model.drop_path: {target} takes no")):
        make_model({"_target_": target, "num_classes": 3, "drop_path": 0.1})


def test_zero_is_off_for_any_model() -> None:
    make_model({"_target_": "torchvision.models.resnet18", "num_classes": 3, "drop_path": 0.0})


def test_an_exported_model_node_names_the_models_own_argument() -> None:
    """model.json's node is what the model's class takes (hydra's instantiate rebuilds it)."""
    from trainkit.models.build import class_arguments

    node = {"_target_": "torchvision.models.convnext_tiny", "num_classes": 3, "weights": None,
            "pretrained": None, "drop_path": 0.1}
    assert class_arguments(node) == {"_target_": "torchvision.models.convnext_tiny",
                                "num_classes": 3, "weights": None,
                                "stochastic_depth_prob": 0.1}
    assert "drop_path" not in class_arguments({**node, "drop_path": 0.0})
