"""``trainkit probe`` on real loaders and models: a slow dataset is input-bound and twice the
workers load it faster, a heavy model on in-memory data is compute-bound, a bad config is one
line and exit 2, and nothing but probe.json is written."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, error_report, offline_env, run_module

pytestmark = [pytest.mark.slow, pytest.mark.serial]

# One intra-op thread: on a 2-core machine the step's threads and the loader's workers would
# otherwise spin against each other and the figures would say more about the machine than the run.
ENV = offline_env(OMP_NUM_THREADS="1")
COMMON = ["+exp=mnist", "trainer.precision=32", "~model.widths", "data.eval_batch_size=64"]


def probe(out: Path, *overrides: str, seconds: str = "0.7") -> subprocess.CompletedProcess[str]:
    """``python -m trainkit.probe``, forked from a zygote started in ENV (the command is what
    is tested, not its start: tests/conftest.py's run_module)."""
    return run_module("trainkit.probe", "--seconds", seconds, "--out", str(out), *COMMON,
                      *overrides, env=ENV, fork=True)


def slow(*extra: str) -> list[str]:
    """A dataset whose samples each sleep, one DataLoader worker, a model that costs nothing."""
    return ["+dataset._target_=tests.helpers.probe_parts.slow_reader", "data.loader=dataloader",
            "data.num_workers=1", "data.batch_size=8",
            "model._target_=tests.helpers.probe_parts.TinyNet", *extra]


def test_a_slow_dataset_is_input_bound_and_two_workers_load_it_faster(tmp_path: Path) -> None:
    out = tmp_path / "figures" / "probe.json"
    out.parent.mkdir()
    result = probe(out, *slow())
    assert result.returncode == 0, result.stderr[-3000:]
    verdicts = [line for line in result.stdout.splitlines() if line.startswith("verdict: ")]
    assert len(verdicts) == 1 and verdicts[0].startswith("verdict: input-bound: "), result.stdout
    report = json.loads(out.read_text())
    assert report["verdict"]["bound"] == "input"
    loader, step, together = report["phases"]
    assert [loader["name"], step["name"], together["name"]] == ["loader", "step", "together"]
    assert together["data_wait_share"] > 0.15
    tried = {v["setting"]: v["samples_per_s"] for v in report["variants"]}
    assert set(tried) == {"data.num_workers=2", "data.loader=memory"}
    assert tried["data.num_workers=2"] > loader["samples_per_s"]  # each sample sleeps: 2 overlap
    assert "data.num_workers=2: loader" in verdicts[0] and "fastest: " in verdicts[0]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["figures", "probe.json"]


def test_a_heavy_model_on_in_memory_data_is_compute_bound(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    result = probe(out, "+dataset._target_=tests.helpers.probe_parts.fast_reader",
                   "+dataset.size=16", "data.loader=memory", "data.batch_size=16",
                   "model._target_=tests.helpers.probe_parts.HeavyNet", "+model.width=48")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["verdict"]["bound"] == "compute", result.stdout
    assert "verdict: compute-bound: " in result.stdout
    assert report["variants"] == []
    assert report["phases"][2]["data_wait_share"] < 0.15
    assert all(0 < p["peak_share"] < 1 for p in report["phases"])


def test_a_config_that_fails_to_build_is_one_line_and_exit_2(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    result = probe(out, "+dataset._target_=tests.helpers.probe_parts.fast_reader",
                   "model._target_=tests.helpers.probe_parts.NoSuchNet")
    assert result.returncode == 2, result.stderr[-3000:]
    _, last = error_report(result.stderr)
    assert "model._target_=tests.helpers.probe_parts.NoSuchNet" in last
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_bad_seconds_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = probe(tmp_path / "probe.json", seconds="0")  # refused before anything is built
    assert result.returncode == 2
    _, last = error_report(result.stderr)
    assert "--seconds must be > 0" in last


def test_the_guides_command_runs_as_written(tmp_path: Path, cifar_root: Path) -> None:
    """docs/gpu-idle.md's (and the README's) ``trainkit probe +exp=cifar``, on the fake CIFAR
    files with a narrow net and short phases appended, in an empty folder: probe.json there."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "docs" / "gpu-idle.md").read_text(), re.S)
    command = next(line for b in blocks for line in b.splitlines()
                   if line.startswith("trainkit probe +exp=cifar")).split("#")[0].strip()
    appended = (f" --seconds 0.3 data.root={cifar_root} data.verify=false data.download=false"
                " trainer.precision=32 trainer.channels_last=false data.batch_size=32"
                " 'model.widths=[8,8,16,16]'")
    env = dict(ENV, PATH=f"{Path(sys.executable).parent}:{ENV['PATH']}", PYTHONPATH=str(REPO))
    result = subprocess.run(command + appended, shell=True, cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "verdict: " in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["probe.json"]  # no outputs/ folder


def test_the_console_command_runs_it(tmp_path: Path) -> None:
    """``trainkit probe --help`` reaches the probe's own parser through the cli."""
    result = subprocess.run([sys.executable, "-m", "trainkit", "probe", "--help"], cwd=REPO,
                            env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "--seconds" in result.stdout and "--out" in result.stdout
