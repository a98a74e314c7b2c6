"""Naming a finished run's checkpoint (either layout) and choosing its weights, without training:
small checkpoint files and folders written as the storages lay them out."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainkit.checkpoint.files import save_atomic
from trainkit.checkpoint.select import available, find_checkpoint, model_weights
from trainkit.core.errors import TrainkitError


def file_run(tmp_path: Path, *, best: bool) -> Path:
    folder = tmp_path / "run" / "checkpoints"
    for step in (4, 8):
        save_atomic({"model": {}, "global_step": step}, folder / f"step_{step:09d}.pt")
    save_atomic({"model": {}, "global_step": 8}, folder / "last.pt")
    if best:
        save_atomic({"model": {}, "global_step": 4}, folder / "best.pt")
    (folder / ".last.pt.tmp").write_bytes(b"half")  # an unfinished save: never a checkpoint
    return tmp_path / "run"


def test_names_in_the_file_layout(tmp_path: Path) -> None:
    run = file_run(tmp_path, best=True)
    assert set(available(run / "checkpoints")) == {"best", "last", "step_4", "step_8"}
    assert find_checkpoint(run, "step_4").name == "step_000000004.pt"  # as the log numbers it
    assert find_checkpoint(run, "step_000000008").name == "step_000000008.pt"
    assert find_checkpoint(run, None).name == "best.pt"  # the commands' default
    path = run / "checkpoints" / "last.pt"
    assert find_checkpoint(run, str(path)) == path


def test_names_in_the_sharded_layout(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "checkpoints"
    (folder / "step_000000006").mkdir(parents=True)
    (folder / "last").symlink_to("step_000000006")
    assert set(available(folder)) == {"last", "step_6"}
    assert find_checkpoint(tmp_path / "run", None) == folder / "last"  # no best: last


def test_missing_checkpoints_say_what_there_is(tmp_path: Path) -> None:
    run = file_run(tmp_path, best=False)
    with pytest.raises(TrainkitError, match=r"kept no best checkpoint .* checkpoint\.monitor"):
        find_checkpoint(run, "best")
    with pytest.raises(TrainkitError, match="no such checkpoint; it has last, step_4, step_8"):
        find_checkpoint(run, "step_5")
    with pytest.raises(TrainkitError, match="has no checkpoints: train it first"):
        find_checkpoint(tmp_path, "last")
    with pytest.raises(TrainkitError, match=r"ckpt=nowhere\.pt: no such file"):
        find_checkpoint(run, "nowhere.pt")


def test_weights_are_the_emas_when_kept_unless_raw_is_asked() -> None:
    raw, ema = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
    with_ema = {"model": raw, "ema": {"weights": ema, "decay": 0.9, "updates": 3}}
    assert model_weights(with_ema)[1] == "ema" and torch.equal(model_weights(with_ema)[0]["w"],
                                                                 ema["w"])
    assert model_weights(with_ema, "raw")[1] == "raw"
    assert model_weights({"model": raw, "ema": None}) == (raw, "raw")
    with pytest.raises(TrainkitError, match=r"kept no EMA .* weights=raw"):
        model_weights({"model": raw, "ema": None}, "ema")
    with pytest.raises(TrainkitError, match="weights=best: use one of auto, ema, raw"):
        model_weights(with_ema, "best")


def test_the_run_is_looked_for_where_its_config_put_its_checkpoints(tmp_path: Path) -> None:
    from trainkit.checkpoint.remote import RemoteCheckpoints
    from trainkit.checkpoint.select import read_whole

    other = file_run(tmp_path / "other", best=True) / "checkpoints"  # another folder
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(f"checkpoint:\n  dir: {other}\n")
    assert find_checkpoint(run, None) == other / "best.pt"
    assert find_checkpoint(run, "step_8") == other / "step_000000008.pt"
    url = "memory://bucket/select-run"  # a store: commit records
    store = RemoteCheckpoints(url, keep_last=2)
    store.save({"model": {"w": torch.ones(1)}, "global_step": 3}, 3, best=True)
    store.save({"model": {"w": torch.zeros(1)}, "global_step": 6}, 6)
    (run / ".hydra" / "config.yaml").write_text(f"checkpoint:\n  dir: {url}/\n")
    assert find_checkpoint(run, None) == f"{url}/best.json"
    assert read_whole(find_checkpoint(run, "step_6"))["model"]["w"].tolist() == [0.0]
    assert read_whole(f"{url}/best.json")["global_step"] == 3  # ckpt=<a record's URL>
    with pytest.raises(TrainkitError, match="no such checkpoint; it has best, last, step_3, "
                                            "step_6"):
        find_checkpoint(run, "step_4")
