"""A run's parts from one config, built once and never written to (trainkit.entry.build)."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import REPO
from tests.image_files import make_folder
from trainkit.core.runtime import Runtime
from trainkit.entry.build import build_metrics, build_parts, build_settings, run_record
from trainkit.entry.train import CONFIG_DIR


def test_the_class_count_is_read_from_the_data_and_the_config_stays_as_given(
        tmp_path: Path) -> None:
    root = make_folder(tmp_path / "pets", classes=3, per_class=2, val_per_class=1,
                       sizes=(16, 24))
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            "data=image_folder", f"data.root={root}", "data.image_size=16", "data.channels=1",
            "data.num_workers=0", "model=resnet18"])
    before = OmegaConf.to_yaml(cfg)
    settings = build_settings(cfg)
    parts = build_parts(cfg, settings, Runtime(torch.device("cpu")))
    images, _ = next(iter(parts.train_data))
    assert parts.num_classes == 3
    assert parts.model(images).shape == (len(images), 3)
    assert build_metrics(cfg, parts.num_classes)["acc"].num_classes == 3
    record = run_record(cfg, parts.num_classes, settings.data.channels)
    assert record["data"]["num_classes"] == 3 and record["model"]["num_classes"] == 3
    assert record["model"]["in_chans"] == 1  # what evaluate, predict and export rebuild
    assert OmegaConf.to_yaml(cfg) == before  # nothing written back into the composed config
    assert cfg.data.num_classes is None


def test_only_build_py_builds_a_model_in_entry() -> None:
    """train, probe, evaluate, predict and export build the model through
    build.build_run_model."""
    builders = {"make_model", "build_model", "build_run_model"}
    for path in sorted((REPO / "trainkit" / "entry").glob("*.py")):
        if path.name == "build.py":
            continue
        tree = ast.parse(path.read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and node.module and not node.module.endswith("entry.build")
                    for alias in node.names}
        assert not builders & imported, path.name
    assert {p.stem for p in (REPO / "trainkit" / "entry").glob("*.py")} - {
        "__init__", "build", "errors", "run_dir", "cli", "train", "evaluate", "predict", "export",
        "probe", "verify_resume", "verify_script", "sweep", "runs", "estimate", "launch",
        "env"} == set()
