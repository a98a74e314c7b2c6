"""data=webdataset through the real entry point: shards written by `python -m trainkit.data
shards` from a generated image folder, then `+exp=folder data=webdataset` trains on them and
evaluates on the validation shards; the run then predicts and exports as an image-folder run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import offline_env, run_module, run_train
from tests.image_files import make_folder
from trainkit import load_model
from trainkit.entry import cli
from trainkit.entry.build import rebuild
from trainkit.entry.export import export_run
from trainkit.entry.predict import image_source

pytestmark = pytest.mark.slow


def test_shards_then_the_entry_point_trains_on_them(tmp_path: Path) -> None:
    make_folder(tmp_path / "pets", classes=2, per_class=6, val_per_class=2, sizes=(12, 16))
    shards = tmp_path / "pets-shards"
    write = run_module("trainkit.data", "shards", str(tmp_path / "pets"), str(shards),
                       "--samples-per-shard", "5", timeout=120)
    assert write.returncode == 0, write.stderr[-2000:]
    assert "3 train shards (12 samples), 1 val shards (4 samples), 2 classes" in write.stdout
    run_dir = tmp_path / "run"
    train = run_train(
        "+exp=folder", "data=webdataset", f"data.root={shards}", f"hydra.run.dir={run_dir}",
        "data.image_size=16", "data.batch_size=4", "data.eval_batch_size=4",
        "data.num_workers=1", "trainer.max_epochs=2", "trainer.precision=32",
        "trainer.channels_last=false", "trainer.log_every_n_steps=1", "trainer.ema_decay=null",
        env=offline_env(OMP_NUM_THREADS="1"), fork=True)
    assert train.returncode == 0, train.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    # 12 training samples, one rank: 3 batches of 4 an epoch
    assert summary["status"] == "completed" and summary["global_step"] == 6
    assert "(3 per epoch)" in (run_dir / "train.log").read_text()
    # after training: predict over image files and export, as for an image-folder run
    rows = tmp_path / "val.pt"
    assert cli.main(["predict", str(run_dir), f"inputs={tmp_path / 'pets' / 'val'}",
                     f"out={rows}"]) == 0
    predicted = torch.load(rows, weights_only=True)
    out = export_run([str(run_dir)], fmt="pt2", out=tmp_path / "export")
    info = json.loads((out / "model.json").read_text())
    assert info["classes"] == ["class_0", "class_1"] and info["image_size"] == [3, 16, 16]
    _, read = image_source(rebuild(run_dir, "", "auto", []))
    with torch.no_grad():
        exported = load_model(out)(torch.stack([read(Path(f)) for f in predicted["inputs"]]))
    assert len(predicted["inputs"]) == 4 and torch.equal(exported, predicted["outputs"])
    # the run's val/acc (over the val shards) is the trained model's accuracy on those 4 images
    labels = torch.tensor([int(Path(f).parent.name.split("_")[1]) for f in predicted["inputs"]])
    right = (predicted["outputs"].argmax(1) == labels).float().mean().item()
    assert summary["metrics"]["val/acc"] == pytest.approx(right), (predicted, summary)
