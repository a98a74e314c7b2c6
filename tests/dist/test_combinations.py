"""Options combined: an all-pairs covering set of runs, each SIGTERMed mid-epoch and resumed.

Every option works alone; what breaks is a combination (FSDP with channels_last, with
bf16-mixed on batch-norm, with compile...). Testing every combination would take thousands of
runs; every *pair* of option values occurs in the 11 rows :func:`pairwise` generates from
:data:`FACTORS` (a new option joins with one line there). Each row trains the built-in
experiments' networks at test size on fake data (tests/dist/combo_fit.py, one process launch
per strategy for its rows, torchrun with 2 processes for ddp and fsdp): once uninterrupted, once
stopped by a real SIGTERM in the middle of the second epoch and resumed. The resumed run must
end with the same weights, buffers, EMA and validation as the uninterrupted one, every rank's
batch-norm statistics must be equal whenever the run evaluated or saved, and each checkpoint
must hold the statistics the run evaluated with.

Bitwise, in every row, compile and 16-mixed included: on the CPU every kernel is deterministic,
gloo sums 2 ranks' gradients in a fixed order, a resumed run compiles the same graphs into the
same kernels, and the GradScaler's state is in the checkpoint. An option whose results depend on
timing or kernel choice (cuDNN autotuning, atomics on a GPU) would go in :data:`TOLERANCES` with
its reason.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from filelock import FileLock

from tests.conftest import REPO, offline_env
from tests.helpers.fakes import write_fake_cifar10, write_fake_mnist
from trainkit.checkpoint import consolidate

pytestmark = pytest.mark.dist

# Each option with the values the runs take; a new option joins the pairwise set with one line.
FACTORS: dict[str, list[Any]] = {
    "strategy": ["none", "ddp", "fsdp"],
    "precision": ["32", "bf16-mixed", "16-mixed"],
    "model": ["mnist", "cifar"],
    "channels_last": [False, True],
    "compile": [False, True],
    "ema": [False, True],
    # on: selective on the cifar net, full on the mnist net and under FSDP (a third value of
    # its own would take 13 rows); trainer.compile=regional compiles these nets whole (their repeated blocks
    # are single layers), so it is true's path here: tests/unit/loop/test_compile_regional.py
    "activation_checkpointing": [False, True],
    "accumulate": [1, 3],
    "async_save": [False, True],
    # trainer.spike on: a snapshot every step (never a spike: taking them must change nothing)
    "spike": [False, True],
    "freeze": [False, True],  # trainer.freeze; in one process unfrozen from the second epoch
    "mixup": [False, True],  # data.mixup + data.cutmix: the training batches mixed on the device
}
# (option, value) -> (absolute tolerance, why not bitwise); empty: every row is bitwise on CPU.
TOLERANCES: dict[tuple[str, Any], tuple[float, str]] = {}


def pairwise(factors: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Rows in which every pair of values of two options occurs at least once (greedy, in the
    manner of AETG: each row starts from the first pair still missing and takes, option by
    option, the value that covers most missing pairs). Deterministic: same factors, same rows."""
    names = list(factors)
    missing = {(a, va, b, vb) for a, b in itertools.combinations(names, 2)
               for va in factors[a] for vb in factors[b]}
    rows: list[dict[str, Any]] = []
    while missing:
        a, va, b, vb = min(missing, key=lambda p: (names.index(p[0]), names.index(p[2]),
                                                     str(p)))
        row = {a: va, b: vb}
        for name in names:
            if name not in row:
                row[name] = max(factors[name], key=lambda v, name=name: sum(
                    (other, row[other], name, v) in missing or (name, v, other, row[other])
                    in missing for other in row))
        row = {name: row[name] for name in names}
        missing -= {(x, row[x], y, row[y]) for x, y in itertools.combinations(names, 2)}
        rows.append(row)
    return rows


ROWS = pairwise(FACTORS)


def _row_id(row: dict[str, Any]) -> str:
    return "-".join(f"{k}" if v is True else str(v) for k, v in row.items() if v is not False)


def test_the_rows_cover_every_pair_of_option_values() -> None:
    for a, b in itertools.combinations(FACTORS, 2):
        seen = {(row[a], row[b]) for row in ROWS}
        assert seen == set(itertools.product(FACTORS[a], FACTORS[b])), (a, b)
    assert len(ROWS) <= 12  # vs 3 * 3 * 2**8 = 2304 combinations


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 96 training samples: 6 batches of 16 an epoch (2 steps of 3 when accumulating 3)
    root = tmp_path_factory.mktemp("combodata")
    write_fake_mnist(root, n_train=96, n_test=32)
    return write_fake_cifar10(root, n_train=96, n_test=32)


def _launch(rows: list[dict[str, Any]], data_root: Path, tmp: Path) -> None:
    """Rows of one strategy in one process launch (under torchrun for ddp and fsdp), each row's
    fits into ``tmp/<row id>``, their results into ``tmp/out.pt``."""
    rows_file, out = tmp / "rows.json", tmp / "out.pt"
    rows_file.write_text(json.dumps({_row_id(row): row for row in rows}))
    launcher = ([] if rows[0]["strategy"] == "none" else
                ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                 "--monitor-interval=0.1"])
    command = [sys.executable, *launcher, "tests/dist/combo_fit.py", str(data_root),
               str(rows_file), str(out)]
    # Inductor compiles in the process itself: no pool of compile workers (each a start of
    # Python and torch) for a few small graphs; the same kernels either way.
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=offline_env(PYTHONPATH=str(REPO), TRAINKIT_DIST_TIMEOUT_S="120",
                                          TORCHINDUCTOR_COMPILE_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


class _Launches:
    """The results of every row, one process launch per strategy (3 starts of Python and torch
    instead of 11, 3 per launch under torchrun): combo_fit.py trains the rows one after the
    other, each from its own seed, model and run dirs. Under xdist the workers share one launch
    per strategy (a file lock in the session's shared temporary folder): the first worker that
    needs it starts it, another waits for it and reads its results."""

    def __init__(self, data_root: Path, where: Path) -> None:
        self.data_root, self.where = data_root, where
        self.results: dict[str, dict[str, Any] | str] = {}

    def result(self, row: dict[str, Any]) -> dict[str, Any]:
        strategy = row["strategy"]
        if strategy not in self.results:
            tmp = self.where / strategy
            try:
                with FileLock(f"{tmp}.lock"):
                    if not (tmp / "out.pt").is_file():
                        tmp.mkdir(parents=True, exist_ok=True)
                        _launch([r for r in ROWS if r["strategy"] == strategy],
                                self.data_root, tmp)
                self.results[strategy] = torch.load(tmp / "out.pt", weights_only=False)
            except (AssertionError, subprocess.TimeoutExpired) as failed:  # each row fails
                self.results[strategy] = str(failed)
        results = self.results[strategy]
        if isinstance(results, str):
            pytest.fail(results, pytrace=False)
        return results[_row_id(row)]


@pytest.fixture(scope="module")
def launches(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> _Launches:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the session's folder, above each worker's
        where = tmp_path_factory.getbasetemp().parent / "combinations"
    else:
        where = tmp_path_factory.mktemp("combinations")
    return _Launches(data_root, where)


def _checkpoint_model(run_dir: str, name: str) -> dict[str, torch.Tensor]:
    """The model checkpoint ``name`` holds (``last``, ``step_<N>``): a file, or a sharded
    directory read whole."""
    path = Path(run_dir) / "checkpoints" / name
    if path.is_dir():
        return consolidate.load_full(path)["model"]
    return torch.load(path.with_suffix(".pt"), map_location="cpu", weights_only=True)["model"]


def _assert_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                  atol: float, what: str) -> None:
    assert got.keys() == expected.keys(), what
    for key in expected:
        if atol:
            torch.testing.assert_close(got[key], expected[key], rtol=0, atol=atol,
                                       msg=f"{what} {key}")
        else:
            assert torch.equal(got[key], expected[key]), f"{what} {key} differs"


# The rows of one launch next to each other, so that an xdist worker tends to get them together.
@pytest.mark.parametrize("row", sorted(ROWS, key=lambda row: FACTORS["strategy"].index(
    row["strategy"])), ids=_row_id)
def test_a_preempted_and_resumed_run_ends_as_the_uninterrupted_one(
        row: dict[str, Any], launches: _Launches) -> None:
    result = launches.result(row)
    whole, preempted, resumed = result["whole"], result["preempted"], result["resumed"]
    assert whole["summary"]["status"] == resumed["summary"]["status"] == "completed"
    assert preempted["summary"]["status"] == "preempted"
    assert preempted["summary"]["global_step"] == result["stop_step"]
    atol = max((TOLERANCES.get((k, v), (0.0, ""))[0] for k, v in row.items()), default=0.0)
    _assert_close(resumed["state"], whole["state"], atol, "final weights/buffers")
    if row["ema"]:
        _assert_close(resumed["ema"], whole["ema"], atol, "EMA")
    metrics = whole["summary"]["metrics"]
    assert metrics.keys() == {"val/loss", "val/acc"}
    assert resumed["summary"]["metrics"] == (pytest.approx(metrics, abs=atol) if atol
                                             else metrics)
    # Batch-norm statistics: the same on every rank after each fit (its last evaluation or
    # save), and the checkpoint holds those the run evaluated with -- also the preemption's.
    for fit in (whole, preempted, resumed):
        first, *others = fit["buffers_by_rank"]
        for other in others:
            _assert_close(other, first, 0.0, "buffers of another rank")
    runs = {"whole": (whole, result["dirs"][0], "last"),
            "preempted": (preempted, result["dirs"][1], f"step_{result['stop_step']:09d}")}
    for what, (fit, run_dir, name) in runs.items():
        saved = _checkpoint_model(run_dir, name)
        _assert_close({k: saved[k] for k in fit["buffers_by_rank"][0]}, fit["buffers_by_rank"][0],
                      0.0, f"{what} checkpoint's buffers")
    if row["compile"]:  # compiled, not silently eager (the fits after the first reuse graphs)
        assert whole["graphs"] + preempted["graphs"] + resumed["graphs"] > 0
