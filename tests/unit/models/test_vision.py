"""torchvision's classifiers from configs/model/ on the data's channels (data.channels=1)."""

from __future__ import annotations

from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch import nn

from tests.image_files import make_folder
from trainkit.core.runtime import Runtime
from trainkit.entry.build import build_parts, run_record
from trainkit.entry.train import CONFIG_DIR
from trainkit.models.vision import adapt_stem, for_channels, torchvision_classifier

TORCHVISION = sorted(p.stem for p in (Path(CONFIG_DIR) / "model").glob("*.yaml")
                     if "_target_: torchvision.models." in p.read_text())


def test_a_grayscale_folder_trains_resnet18(tmp_path: Path) -> None:
    """`data=image_folder data.channels=1 model=resnet18` stopped at the first step with
    'weight of size [64, 3, 7, 7], expected input[64, 1, 28, 28] to have 3 channels'."""
    root = make_folder(tmp_path / "scans", classes=2, per_class=2, val_per_class=1,
                       sizes=(16, 24))
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            "data=image_folder", f"data.root={root}", "data.channels=1", "data.image_size=32",
            "data.num_workers=0", "model=resnet18"])
    parts = build_parts(cfg, OmegaConf.to_object(cfg), Runtime(torch.device("cpu")))
    images, _ = next(iter(parts.train_data))
    assert images.shape[1] == 1
    assert parts.model(images).shape == (len(images), 2)
    # recorded so: evaluate, predict and export rebuild it (the composed config stays as given)
    assert run_record(cfg, parts.num_classes, 1)["model"]["in_chans"] == 1


def test_every_torchvision_model_of_configs_takes_the_datas_channels() -> None:
    assert {"resnet18", "resnet50", "vit_b_16", "efficientnet_b0", "convnext_tiny"} <= set(
        TORCHVISION)
    for name in TORCHVISION:  # the nodes only: building them all costs seconds each
        node = OmegaConf.to_container(OmegaConf.load(Path(CONFIG_DIR) / "model" / f"{name}.yaml"))
        assert for_channels(node, 3) is node  # RGB: torchvision's own, an export needs no more
        gray = for_channels(node, 1)
        assert (gray["name"], gray["in_chans"], gray["weights"]) == (name, 1, None)
    model = torchvision_classifier("efficientnet_b0", num_classes=4, in_chans=1)
    assert model.get_submodule("features.0.0").in_channels == 1  # a stem below the top level


def test_a_trained_stem_summed_over_colour_answers_gray_as_its_rgb_copy() -> None:
    """timm's in_chans way: a one-channel stem made from an RGB stem gives on a gray image what
    the RGB stem gave on that image repeated in R, G and B."""
    torch.manual_seed(0)
    rgb = torchvision_classifier("resnet18", num_classes=3).eval()
    optimizer = torch.optim.SGD(rgb.parameters(), lr=0.1)  # a step: weights no init produced
    nn.functional.cross_entropy(rgb.train()(torch.rand(4, 3, 16, 16)),
                                torch.tensor([0, 1, 2, 0])).backward()
    optimizer.step()
    gray = torchvision_classifier("resnet18", num_classes=3)
    gray.load_state_dict(rgb.state_dict())
    adapt_stem(gray, 1)
    assert gray.conv1.in_channels == 1
    image = torch.rand(2, 1, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(gray.eval()(image), rgb.eval()(image.expand(-1, 3, -1, -1)))
