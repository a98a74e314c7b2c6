"""``model.pretrained``: weights of timm's, torchvision's, trainkit's and Hugging Face's files
matched by name into a model built here, heads of another shape re-initialised, and files that
are not weights refused in one line."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
import torchvision
from safetensors.torch import save_file
from torch import nn

from trainkit.core.errors import ConfigError
from trainkit.models.build import MODEL_KEYS, ModelKeys, class_arguments
from trainkit.models.pretrained import load_pretrained, read_weights


def _trained_like(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """``model``'s state dict with every tensor changed (as training would)."""
    g = torch.Generator().manual_seed(seed)
    return {k: (v + torch.rand(v.shape, generator=g).to(v.dtype)) if v.is_floating_point() else v
            for k, v in model.state_dict().items()}


def _lines(caplog: pytest.LogCaptureFixture, word: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if word in r.getMessage()]


def test_a_timm_checkpoint_file_loads_its_ema_weights_and_reinitialises_the_head(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import timm  # here, not at collection: ~1 s of every worker's start

    source = timm.create_model("resnet10t", num_classes=10)
    raw, ema = _trained_like(source, 1), _trained_like(source, 2)
    # what timm's train.py saves: the wrappers, DDP's prefix, other entries beside them
    torch.save({"epoch": 3, "arch": "resnet10t", "state_dict": {f"module.{k}": v for k, v in
                                                                 raw.items()},
                "state_dict_ema": ema, "optimizer": {}}, tmp_path / "checkpoint.pth.tar")
    model = timm.create_model("resnet10t", num_classes=4)
    fresh_head = model.fc.weight.detach().clone()
    with caplog.at_level(logging.INFO, logger="trainkit"):
        report = load_pretrained(model, tmp_path / "checkpoint.pth.tar")
    assert report["reshaped"] == ["fc.weight", "fc.bias"]
    assert report["missing"] == report["unexpected"] == []
    for name, tensor in model.state_dict().items():
        if not name.startswith("fc."):
            assert torch.equal(tensor, ema[name]), name
    assert torch.equal(model.fc.weight, fresh_head)  # the model's own initialisation
    assert _lines(caplog, "re-initialised") == [
        "model.pretrained: re-initialised, of another shape here: fc.weight [10, 512] -> "
        "[4, 512], fc.bias [10] -> [4]"]
    assert "(its EMA weights)" in _lines(caplog, "weights loaded from")[0]


def test_a_torchvision_state_dict_of_a_compiled_ddp_model_loads_by_name(tmp_path: Path) -> None:
    source = torchvision.models.mobilenet_v3_small(num_classes=10)
    weights = _trained_like(source, 3)
    torch.save({f"module._orig_mod.{k}": v for k, v in weights.items()}, tmp_path / "w.pth")
    model = torchvision.models.mobilenet_v3_small(num_classes=10)
    report = load_pretrained(model, tmp_path / "w.pth")
    assert report["reshaped"] == report["missing"] == report["unexpected"] == []
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name


def test_missing_and_unexpected_names_get_a_line_each(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    weights = _trained_like(net, 4)
    weights.pop("2.bias")
    weights["extra.weight"] = torch.zeros(3)
    save_file(weights, tmp_path / "w.safetensors")
    with caplog.at_level(logging.INFO, logger="trainkit"):
        report = load_pretrained(net, tmp_path / "w.safetensors")
    assert report["missing"] == ["2.bias"] and report["unexpected"] == ["extra.weight"]
    assert _lines(caplog, "missing in the file") == [
        "model.pretrained: missing in the file (the model's own initialisation): 1: 2.bias"]
    assert _lines(caplog, "not in this model") == [
        "model.pretrained: in the file but not in this model (ignored): 1: extra.weight"]


def test_more_than_half_missing_stops_with_the_first_names(tmp_path: Path) -> None:
    save_file({"0.weight": torch.zeros(4, 4)}, tmp_path / "w.safetensors")
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(ConfigError, match=r"fits 1 of this model's 4 weights \(more than 50% "
                       r"missing or of another shape: 3: 0.bias, 1.weight, 1.bias\)"):
        load_pretrained(net, tmp_path / "w.safetensors")


def test_trainkit_checkpoints_and_exports_and_hugging_face_folders(tmp_path: Path) -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    raw, ema = _trained_like(net, 5), _trained_like(net, 6)
    torch.save({"model": raw, "global_step": 7, "ema": {"weights": ema}}, tmp_path / "last.pt")
    weights, which = read_weights(tmp_path / "last.pt")
    assert which == "its EMA weights" and all(torch.equal(weights[k], ema[k]) for k in ema)
    (tmp_path / "export").mkdir()
    save_file(raw, tmp_path / "export" / "model.safetensors")
    (tmp_path / "export" / "model.json").write_text(json.dumps(
        {"format": "safetensors", "file": "model.safetensors"}))
    assert read_weights(tmp_path / "export")[0].keys() == raw.keys()
    # a Hugging Face folder, sharded, its names under the base model's prefix
    hf = tmp_path / "hf"
    hf.mkdir()
    names = sorted(raw)
    save_file({f"base.{k}": raw[k] for k in names[:2]}, hf / "model-00001-of-00002.safetensors")
    save_file({f"base.{k}": raw[k] for k in names[2:]}, hf / "model-00002-of-00002.safetensors")
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        f"base.{k}": f"model-0000{1 + (i >= 2)}-of-00002.safetensors"
        for i, k in enumerate(names)}}))
    report = load_pretrained(net, hf)
    assert sorted(report["loaded"]) == sorted(net.state_dict())
    assert all(torch.equal(t, raw[k]) for k, t in net.state_dict().items())
    torch.save({f"base.{k}": v for k, v in raw.items()}, tmp_path / "pytorch_model.bin")
    (hf / "model.safetensors.index.json").unlink()
    os.replace(tmp_path / "pytorch_model.bin", hf / "pytorch_model.bin")
    assert read_weights(hf)[0].keys() == {f"base.{k}" for k in raw}


def test_files_that_are_not_weights_are_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "junk.pt").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match=r"junk.pt is not a weights file that loads safely "
                       r"\(Unsupported operand"):
        read_weights(tmp_path / "junk.pt")

    ran = tmp_path / "ran"

    class Code:
        def __reduce__(self):
            return os.system, (f"touch {ran}",)

    torch.save({"state_dict": Code()}, tmp_path / "evil.pth")
    with pytest.raises(ConfigError, match=r"it names \S*system: a pickled object or code"):
        read_weights(tmp_path / "evil.pth")
    assert not ran.exists()
    torch.save({"epoch": 3, "lr": 0.1}, tmp_path / "meta.pth")
    with pytest.raises(ConfigError, match="holds no state dict"):
        read_weights(tmp_path / "meta.pth")
    with pytest.raises(ConfigError, match="a folder without weights"):
        read_weights(tmp_path)
    with pytest.raises(ConfigError, match="no such file or folder"):
        read_weights(tmp_path / "nothing.pt")


def test_a_run_folder_is_refused_naming_where_its_checkpoints_are(tmp_path: Path) -> None:
    """A run's checkpoints are where its recorded checkpoint.dir put them, not always in
    ``<run>/checkpoints`` (issue 59): the line names that folder."""
    elsewhere = tmp_path / "ckpts"
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(f"checkpoint:\n  dir: {elsewhere}\n")
    with pytest.raises(ConfigError, match=rf"is a run: give one of its checkpoint files "
                       rf"\(in {elsewhere}\)"):
        read_weights(run)
    (run / ".hydra" / "config.yaml").write_text("checkpoint:\n  dir: null\n")
    with pytest.raises(ConfigError, match=rf"\(in {run / 'checkpoints'}\)"):
        read_weights(run)


def test_the_model_node_leaves_out_what_trainkit_reads() -> None:
    assert class_arguments({"_target_": "m.Net", "pretrained": "w.pt", "width": 3,
                            "lora": {"r": 8}}) == {"_target_": "m.Net", "width": 3}


def test_trainkits_own_model_keys_are_listed_once_and_typed() -> None:
    """Issue 59, item 3: ``model.pretrained``, ``model.lora`` (and issue 62's ``model.drop_path``)
    in one typed place."""
    assert MODEL_KEYS == ("pretrained", "lora", "drop_path")
    keys, rest = ModelKeys.split({"_target_": "m.Net", "pretrained": None, "lora": {"r": 8}})
    assert keys == ModelKeys(pretrained=None, lora={"r": 8}) and rest == {"_target_": "m.Net"}
    with pytest.raises(ConfigError, match=r"model\.pretrained must be a weights file or folder"):
        ModelKeys.split({"_target_": "m.Net", "pretrained": True})
    with pytest.raises(ConfigError, match=r"model\.lora must be a mapping"):
        ModelKeys.split({"_target_": "m.Net", "lora": 8})


def test_a_resumed_run_may_name_other_pretrained_weights_but_not_another_model() -> None:
    from trainkit.checkpoint.contents import check_config
    from trainkit.core.errors import TrainkitError

    saved = {"config": {"model": {"_target_": "m.Net", "width": 3, "pretrained": "a.pt"}}}
    check_config(saved, {"model": {"_target_": "m.Net", "width": 3, "pretrained": None}})
    with pytest.raises(TrainkitError, match=r"another model\.width"):
        check_config(saved, {"model": {"_target_": "m.Net", "width": 4, "pretrained": "a.pt"}})
