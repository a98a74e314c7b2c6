"""Benchmarks run end to end in their tiny mode and print well-formed results (speed unchecked)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import overhead
from benchmarks.__main__ import table
from tests.conftest import REPO, offline_env, run_module

pytestmark = pytest.mark.slow
HAS_LIGHTNING = importlib.util.find_spec("lightning") is not None


def _run(module: str, *args: str) -> dict[str, Any]:
    result = run_module(module, "--quick", *args)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout[result.stdout.index("{"):])


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _check_rows(rows: list[dict[str, Any]]) -> None:
    assert rows
    for r in rows:
        assert set(r) == {"name", "value", "unit", "goal", "met"}
        value = r["value"]
        if r["name"].startswith("mlflow: cost per fit"):  # a difference: noise may make it < 0
            assert isinstance(value, float) and math.isfinite(value), r
        else:
            assert value is None or _positive(value), r
        if r["met"] is not None:  # a judged goal: by its own comparison, where it states one
            assert isinstance(r["met"], bool), r
            if _GOAL.search(r["goal"]):
                assert r["met"] == _judged(value, r["goal"]), r
        if value is None:  # a skipped side is not judged; a failed one is not met
            assert r["met"] is (False if r["goal"].startswith("(failed") else None), r


# A goal's comparison: "> 1 (overlap)", ">= 1.5x", "< 1e-3 (same losses)", "~1/2 (<= 0.55)".
_GOAL = re.compile(r"(>=|<=|>|<)\s*(\d+(?:\.\d+)?(?:e-?\d+)?)")


def _judged(value: float | None, goal: str) -> bool:
    """Whether ``value`` meets ``goal``, by the comparison written in the goal."""
    if value is None:
        return False
    op, text = _GOAL.search(goal).group(1, 2)
    bound = float(text)
    return {">=": value >= bound, "<=": value <= bound, ">": value > bound,
            "<": value < bound}[op]


def _check_samples(samples: dict[str, list[list[float]]], rounds: int) -> None:
    for per_round in samples.values():
        assert len(per_round) == rounds
        assert all(len(pair) == 2 and all(map(_positive, pair)) for pair in per_round)


def _check_checkpoint(result: dict[str, Any]) -> None:
    assert 0.5 < result["state_mb"] < 2
    assert set(result["median_s"]) == {"durable", "bare", "manager", "async_blocked"}
    assert result["rows"][0]["name"] == "checkpoint: manager.save/durable torch.save"
    assert result["rows"][0]["value"] == result["ratios"]["manager/durable"]
    assert all(map(_positive, result["ratios"].values()))
    _check_samples(result["samples"], result["rounds"])
    _check_rows(result["rows"])


def _check_loaders(result: dict[str, Any]) -> None:
    for name in ("mnist", "cifar10"):
        r = result[name]
        assert r["in_memory_samples_per_s"] > 0 and r["per_sample_samples_per_s"] > 0
        assert r["ratio"] == r["in_memory_samples_per_s"] / r["per_sample_samples_per_s"]
    factory = result["make_loader_vs_dataloader"]
    assert set(factory) == {"tensors", "torchvision_mnist", "entry_point_mnist"}
    for r in factory.values():
        assert _positive(r["make_loader_samples_per_s"]) and _positive(r["ratio"])
        assert _positive(r["dataloader_samples_per_s"]) and r["num_workers"] == 1
    _check_rows(result["rows"])
    assert len(result["rows"]) == 5


def _check_activation_memory(result: dict[str, Any]) -> None:
    assert _positive(result["plain_step_peak_mib"]) and _positive(result["ratio"])
    _check_rows(result["rows"])


def test_overhead_quick_with_every_side(tmp_path: Path) -> None:
    result = _run("benchmarks.overhead", "--callback", "--mlflow", f"file:{tmp_path}/mlruns")
    assert set(result["steps_per_s"]) >= {"loop", "trainkit", "trainkit+callback", "trainkit@50",
                                          "trainkit+mlflow"}
    assert all(map(_positive, result["steps_per_s"].values()))
    for name in ("trainkit/loop", "trainkit+callback/loop", "trainkit+mlflow/trainkit",
                 "trainkit+mlflow/trainkit, whole fits"):
        assert _positive(result["ratios"][name])
    assert _positive(result["mlflow_close_s"])
    assert isinstance(result["mlflow_ms_per_fit"], float)  # a difference: noise may make it < 0
    assert any((tmp_path / "mlruns").rglob("meta.yaml"))  # the MLflow side made its runs
    _check_samples(result["samples"], result["rounds"])
    _check_rows(result["rows"])
    if HAS_LIGHTNING:
        assert result["lightning"] == "measured"
        assert _positive(result["ratios"]["lightning/loop"])
        assert _positive(result["ratios"]["trainkit/lightning"])
    else:
        assert result["lightning"].startswith("skipped")


def test_overhead_without_lightning_reports_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules makes `import lightning.pytorch` raise ImportError, as if uninstalled.
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    result = overhead.main(["--steps", "5", "--rounds", "1"])
    assert result["lightning"].startswith("skipped")
    assert set(result["ratios"]) == {"trainkit/loop"}
    (skipped,) = [r for r in result["rows"] if "lightning" in r["name"]]
    assert skipped["value"] is None and skipped["met"] is None


def test_mnist_e2e_quick() -> None:
    result = _run("benchmarks.mnist_e2e")
    assert result["quick"] is True
    for side in ("trainkit", "hand"):
        (first, second) = result["runs"][side]  # one round: each side ran twice
        for run in (first, second):
            assert run["process_s"] > run["train_s"] > 0
            # 5 steps learn the generated digits well above chance (0.1): both sides train
            assert run["val_acc"] > 0.3, run
        accs = [first["val_acc"], second["val_acc"]]
        assert result["val_acc"][side] == sum(accs) / 2 and result["min_val_acc"][side] == min(
            accs)
    assert all(r["process_s"] > r["startup_s"] > 0 for r in result["runs"]["trainkit"])
    assert result["precision"] in ("32", "bf16-mixed")
    assert _positive(result["ratio"])
    _check_samples(result["samples"], 1)
    _check_rows(result["rows"])


def test_precision_quick() -> None:
    result = _run("benchmarks.precision")
    assert result["auto"] in ("32", "bf16-mixed") and result["auto_reason"]
    assert set(result["models"]) == {"mnist", "cifar"}
    for r in result["models"].values():
        assert _positive(r["bf16/32"])
        assert r["faster"] == ("bf16-mixed" if r["bf16/32"] < 1 else "32")
        _check_samples(r["samples"], 1)
    for name, r in result["models"].items():  # each model's goal, "auto picks the faster"
        (line,) = [x for x in result["rows"] if x["name"].startswith(f"precision: {name} ")]
        assert line["value"] == r["bf16/32"] and line["met"] == (result["auto"] == r["faster"])
    _check_rows(result["rows"])


def test_packing_quick() -> None:
    """Both sides train on the same documents, lengths varying 10x; packed counts as many real
    tokens per step or more."""
    result = _run("benchmarks.packing")
    assert result["doc_tokens"]["max"] >= 5 * result["doc_tokens"]["min"], result["doc_tokens"]
    assert _positive(result["padded_tokens_per_s"]) and _positive(result["packed_tokens_per_s"])
    _check_rows(result["rows"])


def test_fsdp_memory_quick() -> None:
    """Bytes, not time: exact on any machine. Even-sized layers split exactly in half."""
    result = _run("benchmarks.fsdp_memory")
    ddp, sharded = result["ddp_per_rank"], result["fsdp_per_rank"]
    assert len(ddp) == len(sharded) == 2
    for full, half in zip(ddp, sharded):
        assert full["grads"] == full["params"] and full["optimizer"] == 2 * full["params"]
        assert {k: 2 * v for k, v in half.items()} == full
    assert result["ratio"] == 0.5
    _check_rows(result["rows"])


def test_gpu_says_why_not_without_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the next test runs the script for real")
    assert "CUDA" in _run("benchmarks.gpu")["skipped"]


def test_gpu_quick_runs_its_code_on_the_cpu(tmp_path: Path) -> None:
    """The GPU script's code paths on tiny sizes, so the one run on a lent GPU does not fail."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = tmp_path / "gpu.json"
    result = _run("benchmarks.gpu", "--device", device, "--out", str(out))
    assert json.loads(out.read_text()) == result
    for speeds in (result["loader_samples_per_s"], result["cifar_train_samples_per_s"]):
        assert set(speeds) == {"dataloader_no_prefetcher", "dataloader_prefetcher",
                               "in_memory_gpu_resident"}
        assert all(map(_positive, speeds.values()))
    assert set(result["precision"]) == {"32", "bf16-mixed", "16-mixed"}
    shaped = result["shaped_run"]
    assert shaped["process_s"] > shaped["train_s"] > 0 and shaped["steps"] > 0, shaped
    assert "+exp=cifar" in shaped["command"]
    _check_rows(result["rows"])


def test_runner_quick_writes_json_and_table(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    # an earlier quick run's gpu result: a run of other benchmarks (--only) keeps it
    earlier = {"name": "gpu: earlier", "value": 1.0, "unit": "x", "goal": "-", "met": None}
    out.write_text(json.dumps({"quick": True, "benchmarks": {"gpu": {"rows": [earlier]}}}))
    # The runner's aggregation, and the checkpoint benchmark's own figures (the runner stores
    # each benchmark's result as the benchmark prints it).
    proc = run_module("benchmarks", "--quick", "--only", "overhead,checkpoint", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())
    assert {"cpu", "logical_cores", "torch", "date"} <= set(results["machine"])
    assert set(results["benchmarks"]) == {"overhead", "checkpoint", "gpu"}
    _check_checkpoint(results["benchmarks"]["checkpoint"])
    _check_rows(results["table"])
    assert results["table"][-1] == earlier  # the table in the runner's order, gpu last
    assert "checkpoint: manager.save/durable torch.save" in proc.stdout
    assert "gpu: earlier" not in proc.stdout  # the printed table: this run's rows
    assert "results written to" in proc.stdout


def test_runner_quick_leaves_the_tracked_results_alone() -> None:
    """`python -m benchmarks --quick` as the docs write it: exit 0, the full runs' results.json
    untouched, the tiny figures in the ignored results.quick.json with no goal judged.

    activation_memory runs after loaders, as in the full list: its child processes then start
    with the runner's larger peak RSS, which made it fail (division by zero). The two
    benchmarks' own figures are checked here too."""
    tracked = REPO / "benchmarks" / "results.json"
    quick = REPO / "benchmarks" / "results.quick.json"
    before = tracked.read_bytes()
    quick.unlink(missing_ok=True)
    proc = run_module("benchmarks", "--quick", "--only", "loaders,activation_memory")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert tracked.read_bytes() == before
    results = json.loads(quick.read_text())
    assert results["quick"] is True
    assert "failed" not in results["benchmarks"]["activation_memory"]
    _check_loaders(results["benchmarks"]["loaders"])
    _check_activation_memory(results["benchmarks"]["activation_memory"])
    _check_rows(results["table"])
    assert all(r["met"] is None for r in results["table"]), results["table"]
    assert "goals are not judged" in proc.stdout
    assert subprocess.run(["git", "check-ignore", "-q", str(quick)], cwd=REPO).returncode == 0


def test_runner_reports_a_failed_benchmark_and_runs_the_others(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    # The full MNIST benchmark needs the real files: an empty data dir fails it at once (offline).
    proc = run_module("benchmarks", "--only", "mnist_e2e,gpu", "--out", str(out),
                      env=offline_env(TRAINKIT_DATA_DIR=str(tmp_path), CUDA_VISIBLE_DEVICES=""))
    # (no GPU: gpu skips at once)
    assert proc.returncode == 1, proc.stderr[-2000:]
    results = json.loads(out.read_text())
    assert "MNIST not found" in results["benchmarks"]["mnist_e2e"]["failed"]
    assert "gpu" in results["benchmarks"]  # ran after the failure
    assert "benchmarks failed: mnist_e2e" in proc.stderr
    assert any(line.startswith("mnist_e2e") and "failed" in line
               for line in proc.stdout.splitlines())


def test_table_marks_skipped_failed_and_missed_goals() -> None:
    text = table([
        {"name": "a", "value": 0.5, "unit": "x", "goal": ">= 1", "met": False},
        {"name": "b", "value": None, "unit": "x", "goal": "> 1", "met": None},
        {"name": "c", "value": None, "unit": "x", "goal": "(failed)", "met": False},
    ])
    a, b, c = (line.split() for line in text.splitlines()[1:])
    assert a[1] == "0.500x" and a[-1] == "NO"
    assert b[1] == "skipped" and b[-1] == "-"
    assert c[1] == "failed" and c[-1] == "NO"
