"""After training, for a run whose checkpoints are not in its own folder: ``checkpoint.dir`` set
to another local folder, and to an S3 URL (moto's server, commit records). ``trainkit
evaluate``, ``predict``, ``export`` and ``trainkit.load_model`` find them where the run's
config put them and reproduce the run's recorded best (issue 59 item 2, issue 61 fault 6).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import offline_env, run_train, tiny_run
from tests.helpers.s3 import s3_environment
from trainkit import load_model
from trainkit.checkpoint.select import find_checkpoint
from trainkit.data.loader.memory import InMemoryLoader
from trainkit.data.sources.tensors import TensorData, load_mnist
from trainkit.entry import cli
from trainkit.entry.evaluate import evaluate_run
from trainkit.entry.export import export_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["folder", "s3"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
        mnist_root: Path) -> Iterator[tuple[Path, str]]:
    """8 steps evaluated every 4 with an EMA, ``best`` by the HIGHEST val/loss (an early step,
    not the last), its checkpoints in ``checkpoint.dir``: (run folder, that dir)."""
    run_dir = tmp_path_factory.mktemp(f"run_{request.param}")
    with contextlib.ExitStack() as stack:
        extra: dict[str, str] = {}
        if request.param == "folder":
            where = str(tmp_path_factory.mktemp("elsewhere") / "ckpts")
        else:  # the server's environment set here too: the readers run in this process
            server = stack.enter_context(s3_environment(request.getfixturevalue("moto_s3")))
            server.bucket("elsewhere")
            where, extra = "s3://elsewhere/run", server.env
        result = run_train(*tiny_run(run_dir, mnist_root, "model.widths=[8,16,32]",
                                     "trainer.max_steps=8", "trainer.eval_every_n_steps=4",
                                     "trainer.ema_decay=0.9", "checkpoint.every_n_steps=4",
                                     "checkpoint.monitor=val/loss", "checkpoint.mode=max",
                                     f"checkpoint.dir={where}"), env=offline_env(**extra))
        assert result.returncode == 0, result.stderr[-3000:]
        assert not (run_dir / "checkpoints").exists()  # nothing to find in the run's folder
        yield run_dir, where


def recorded_best(run_dir: Path) -> tuple[int, dict[str, float]]:
    """summary.json's best step and the evaluation metrics.jsonl recorded at that step."""
    best = json.loads((run_dir / "summary.json").read_text())["best"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    at = {row.pop("step"): row for row in rows if "val/loss" in row}
    assert best["value"] == at[best["step"]]["val/loss"]
    return best["step"], at[best["step"]]


def test_evaluate_reproduces_the_recorded_best_from_where_the_checkpoints_are(
        run: tuple[Path, str]) -> None:
    run_dir, where = run
    step, metrics = recorded_best(run_dir)
    assert step < 8  # by the highest val/loss: not the last step
    assert str(find_checkpoint(run_dir, None)).startswith(where)  # best, in checkpoint.dir
    record = evaluate_run(run_dir, "best")
    assert record["step"] == step and record["metrics"] == metrics  # bitwise
    assert record["checkpoint"].startswith(where)
    assert (run_dir / "eval_best.json").is_file()
    # the checkpoint named by its own path (a record's URL in the bucket) reproduces it too
    named = evaluate_run(run_dir, str(find_checkpoint(run_dir, "best")))
    assert named["step"] == step and named["metrics"] == metrics
    assert evaluate_run(run_dir, "step_4")["step"] == 4


def test_predict_export_and_load_model_give_the_best_checkpoints_outputs(
        run: tuple[Path, str], mnist_root: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    run_dir, _ = run
    test = load_mnist(mnist_root, train=False, verify=False, download=False)
    split = TensorData(test.images[:20], test.labels[:20], test.mean, test.std, test.num_classes)
    batch = next(iter(InMemoryLoader(split, 20, shuffle=False)))[0]
    with torch.no_grad():
        logits = load_model(run_dir)(batch)  # ckpt=best
    out = tmp_path / "outputs.pt"
    assert cli.main(["predict", str(run_dir), "inputs=test", f"out={out}"]) == 0
    assert torch.equal(torch.load(out, weights_only=True)["outputs"][:20], logits)
    export_run([str(run_dir)], out=tmp_path / "export")
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path / "export")(batch), logits)
    assert "train it first" not in capsys.readouterr().err
