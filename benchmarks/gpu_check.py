"""Every CUDA path of trainkit once, each as a case that fails when the path is broken.

    bash benchmarks/gpu_check.sh --plan                     # the batches, anywhere
    bash benchmarks/gpu_check.sh --batch 1 <out_dir>        # on a GPU machine (brings Hydra along)
    python -m benchmarks.gpu_check <out_dir>                # every case, Hydra already installed
    python -m benchmarks.gpu_check <out_dir> --device cpu --only sigterm_resume   # (the tests)

Writes ``<out_dir>/gpu_check.json`` after every case (every case so far: ok, seconds, what it
measured or why it failed; the sync counts; the throughput figures) and prints everything else,
ending with every case and its PASS/FAIL and the torch/CUDA versions (``gpu_check.sh`` keeps it
as ``<out_dir>/gpu_check.log``). The cases come in batches (``BATCHES``), each expected to fit
one call of a lent machine (``--plan`` lists them with each case's expected seconds on one H100
and the device call); no case starts after ``--deadline`` seconds (a case not run then fails).
``gpu_tests`` runs the GPU-marked tests of tests/, collected first: every one, wherever it lives
(``trainkit estimate`` against ``torch.cuda.max_memory_allocated`` among them:
tests/unit/entry/test_estimate.py); one skipped fails the case, but for one that "needs 2
GPUs" on a machine with one (listed as not run). On CUDA a case that is not run
fails, but for ``nccl`` on one GPU: ``NOT RUN (needs 2 GPUs)``, which a one-GPU verdict does not
count. Runs go to a temporary folder, deleted at the end. Independent cases run four at a time;
the timing ones (``gpu_decode``, ``syncs``, ``throughput``) run alone, in a batch of their own.
Without CUDA (and no ``--device cpu``): one line, exit 0 on a machine without a GPU, exit 1 when
``nvidia-smi`` lists one that torch cannot use. Exit status 1 when a case failed.

Comparisons between runs are bitwise: those runs go through
:mod:`benchmarks.deterministic_train` (deterministic cuDNN/cuBLAS/torch kernels), so a
difference is about checkpointing and resuming, not about kernels; the JSON gives the largest
absolute difference of the weights as well.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import REPO
from trainkit.core.errors import one_line

Case = Callable[["Context"], dict[str, Any]]
CASE_TIMEOUT_S = 240  # one process; the whole check aims at <= 8 minutes on an H200
_print_lock = threading.Lock()


class CaseFailed(Exception):
    """A case's check did not hold; the message says which."""


class NotRun(Exception):
    """A case this machine cannot run (one GPU where it needs two): stated, not failed."""


NEEDS_2_GPUS = "needs 2 GPUs"


class Context:
    """Where the runs go, the data, the device and the overrides every run of a kind shares."""

    def __init__(self, work: Path, device: str, deadline: float = float("inf")) -> None:
        from tests.helpers.fakes import write_fake_cifar10, write_fake_mnist

        self.work, self.device, self.deadline = work, device, deadline
        self.cuda = device == "cuda"
        data = work / "data"
        write_fake_mnist(data)
        write_fake_cifar10(data, n_train=10_000 if self.cuda else 512, n_test=1_000 if self.cuda
                           else 128)
        common = [f"data.root={data}", "data.verify=false", "data.download=false"]
        # CIFAR on a GPU (bf16, channels_last, the in-memory loader); on a CPU (the tests) the
        # small MNIST net in fp32, whatever the CPU's bf16
        self.exp = (["+exp=cifar", *common] if self.cuda else
                    ["+exp=mnist", *common, "data.batch_size=32", "trainer.device=cpu",
                     "trainer.precision=32"])
        self.mnist = ["+exp=mnist", *common, "data.batch_size=32"]

    def run_dir(self, name: str) -> Path:
        return self.work / "runs" / name

    def timeout(self, most: float = 240.0) -> float:
        """A process's time limit: ``most`` seconds, or what is left before the deadline."""
        return max(1.0, min(most, self.deadline - time.monotonic()))

    def train(self, name: str, *overrides: str, module: str = "trainkit.train",
              launcher: tuple[str, ...] = (), expect: int = 0, exp: list[str] | None = None
              ) -> dict[str, Any]:
        """``python -m <module> <exp> <overrides>`` into run dir ``name``; its outcome."""
        run = self.run_dir(name)
        cmd = [sys.executable, *launcher, "-m", module, *(self.exp if exp is None else exp),
               *overrides, f"hydra.run.dir={run}"]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                              timeout=self.timeout(CASE_TIMEOUT_S))
        output = proc.stdout + proc.stderr
        if proc.returncode != expect:
            last = (proc.stderr.strip().splitlines() or output.strip().splitlines() or ["-"])[-1]
            raise CaseFailed(f"exit status {proc.returncode}, not {expect}: {last[:300]}")
        summary_file = run / "summary.json"
        summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
        return {"run": run, "summary": summary, "output": output, "stderr": proc.stderr}


def completed(outcome: dict[str, Any]) -> dict[str, Any]:
    """The summary of a run that must have completed with finite metrics."""
    summary = outcome["summary"]
    if summary.get("status") != "completed":
        raise CaseFailed(f"status {summary.get('status')!r}, not 'completed'")
    bad = {k: v for k, v in summary["metrics"].items() if not math.isfinite(v)}
    if bad:
        raise CaseFailed(f"non-finite metrics {bad}")
    return {k: summary[k] for k in ("global_step", "samples_per_s", "metrics", "peak_memory")}


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def compare(a: Path, b: Path) -> float:
    """Largest absolute difference between two checkpoints' weights; CaseFailed unless 0."""
    wa, wb = weights(a), weights(b)
    if wa.keys() != wb.keys():
        raise CaseFailed(f"{a.name} and {b.name} hold different tensors")
    diff = max(((x.double() - y.double()).abs().max().item() if x.is_floating_point()
                else float(not torch.equal(x, y))) for x, y in zip(wa.values(), wb.values()))
    if diff != 0.0:
        raise CaseFailed(f"{b} differs from {a}: largest weight difference {diff:.3g}")
    return diff


# -- the cases ------------------------------------------------------------------------------------

GPU_TESTS_TIMEOUT_S = 480  # every GPU-marked test, slow ones (training subprocesses) included


def gpu_tests(ctx: Context, where: str | Path = "tests") -> dict[str, Any]:
    """``pytest -m gpu`` over ``where`` (every GPU-marked test in tests/, found by its mark),
    judged on the GPU-marked tests alone: they are collected first, then run. A module that
    cannot be imported here (a package the GPU image lacks: nbformat, say) or skips at import
    (trackers, Hugging Face data) holds no test that counts, unless its source marks a test
    ``gpu`` and it fails to import: that fails the case. A failure, an error, a skip of a
    collected test, or no test at all fails the case; but for a test skipped because it
    ``needs 2 GPUs`` (its reason says so) on a machine with one: listed as not run."""
    common = ["-m", "gpu", "-p", "no:cacheprovider", "--continue-on-collection-errors"]
    collect = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *common,
                              str(where)], cwd=REPO, capture_output=True, text=True,
                             timeout=_timeout(ctx, GPU_TESTS_TIMEOUT_S))
    ids = [line.strip() for line in collect.stdout.splitlines()
           if "::" in line and not line.startswith(("ERROR", "SKIPPED", " "))]
    broken = [m for m in _uncollected(collect.stdout) if _marks_gpu(m, where)]
    if broken:
        raise CaseFailed(f"module(s) with GPU-marked tests fail to import: {', '.join(broken)}"
                         f"\n{collect.stdout[-2000:]}")
    if not ids:
        last = (collect.stdout.strip().splitlines() or ["-"])[-1]
        raise CaseFailed(f"pytest -m gpu ran no test under {where}: {last}")
    report = Path(tempfile.mkdtemp(dir=ctx.work)) / "pytest.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", *common,
                           f"--junitxml={report}", str(where)],
                          cwd=REPO, capture_output=True, text=True,
                          timeout=_timeout(ctx, GPU_TESTS_TIMEOUT_S))
    counts, skipped = _junit(report)
    last = (proc.stdout.strip().splitlines() or ["-"])[-1]
    if counts["failures"] or counts["errors"] or proc.returncode not in (0, 1, 5):
        raise CaseFailed(f"pytest -m gpu: {last}\n{proc.stdout[-3000:]}{proc.stderr[-1000:]}")
    # a test that says it needs 2 GPUs, on a machine with fewer: stated, as the nccl case is
    not_run = ([s for s in skipped if NEEDS_2_GPUS in s] if torch.cuda.device_count() < 2
               else [])
    skipped = [s for s in skipped if s not in not_run]
    if skipped:
        raise CaseFailed(f"{len(skipped)} GPU-marked test(s) skipped, not run: "
                         f"{'; '.join(skipped)[:1500]}")
    if counts["tests"] != len(ids):
        raise CaseFailed(f"{len(ids)} GPU-marked test(s) collected, {counts['tests']} run: {last}")
    return {"tests": counts["tests"], "pytest": last,
            **({f"not_run ({NEEDS_2_GPUS})": not_run} if not_run else {})}


def _timeout(ctx: Any, most: float) -> float:
    return ctx.timeout(most) if hasattr(ctx, "timeout") else most


def _uncollected(output: str) -> list[str]:
    """The modules a collection reports as errors (they could not be imported)."""
    import re

    return sorted(set(re.findall(r"^ERROR\s+(\S+?\.py)\b", output, re.MULTILINE)))


def _marks_gpu(module: str, where: str | Path) -> bool:
    """Whether a module's source marks a test ``gpu`` (it could not be imported to ask it);
    pytest names it from the repository, or from ``where`` when that lies outside it."""
    for base in (REPO, Path(where)):
        with contextlib.suppress(OSError):
            return "mark.gpu" in (base / module).read_text()
    return False


def _junit(report: Path) -> tuple[dict[str, int], list[str]]:
    """Test, failure, error counts of a pytest JUnit report, and each skipped test with why."""
    import xml.etree.ElementTree as ET

    if not report.is_file():
        return {"tests": 0, "failures": 0, "errors": 1}, []
    # a module's collection error or skip at import is a test case without a class name:
    # not a test (gpu_tests judges such modules from the collection)
    cases = [c for c in ET.parse(report).getroot().iter("testcase") if c.get("classname")]
    skipped = [f"{c.get('classname')}::{c.get('name')} ({s.get('message', '')[:120]})"
               for c in cases for s in c.findall("skipped")]
    return {"tests": len(cases), "failures": sum(bool(c.findall("failure")) for c in cases),
            "errors": sum(bool(c.findall("error")) for c in cases)}, skipped


def compile_(ctx: Context) -> dict[str, Any]:
    return completed(ctx.train("compile", "trainer.compile=true", "trainer.max_steps=30"))


AC = "trainer.activation_checkpointing=[features]"  # the conv stack, batch-norms inside


def activation_checkpointing(ctx: Context) -> dict[str, Any]:
    return completed(ctx.train("activation_checkpointing", AC, "trainer.max_steps=30"))


def compile_and_activation_checkpointing(ctx: Context) -> dict[str, Any]:
    return completed(ctx.train("compile_ac", "trainer.compile=true", AC, "trainer.max_steps=30"))


def _exact(ctx: Context) -> tuple[int, tuple[str, ...]]:
    """Steps M of the runs compared bitwise, and their overrides: constant LR (a resumed run may
    extend it), checkpoints every M/6 kept, evaluation at the end only, a log line every 10."""
    m = 180 if ctx.cuda else 30  # checkpoints every 30 steps on CUDA: a bitwise check in <2 min
    return m, ("sched=constant", f"checkpoint.every_n_steps={m // 6}", "checkpoint.keep_last=100",
               "trainer.max_epochs=1000", "trainer.eval_every_n_epochs=1000",
               "trainer.log_every_n_steps=10")


DETERMINISTIC = "benchmarks.deterministic_train"
_straight_lock = threading.Lock()


def _straight(ctx: Context) -> Path:
    """The reference run (made once, whichever case asks first)."""
    with _straight_lock:
        run = ctx.run_dir("straight")
        if not (run / "summary.json").exists():
            m, exact = _exact(ctx)
            completed(ctx.train("straight", *exact, f"trainer.max_steps={m}", module=DETERMINISTIC))
        return run


def async_save_resume(ctx: Context) -> dict[str, Any]:
    """``checkpoint.async_save`` on an explicit ``cuda:0``: every snapshot equals the synchronous
    run's checkpoint of the same step, and a resume from the async checkpoint ends equal."""
    m, exact = _exact(ctx)
    device = ["trainer.device=cuda:0"] if ctx.cuda else []
    args = (*exact, "checkpoint.async_save=true", *device)
    ctx.train("async", *args, f"trainer.max_steps={m // 2}", module=DETERMINISTIC)
    resumed = ctx.train("async", *args, f"trainer.max_steps={m}", module=DETERMINISTIC)
    if f"at step {m // 2}" not in resumed["output"]:
        raise CaseFailed(f"the second run did not resume from step {m // 2}")
    straight = _straight(ctx) / "checkpoints"
    steps = sorted(p.name for p in straight.glob("step_*.pt"))
    for name in steps:
        compare(straight / name, ctx.run_dir("async") / "checkpoints" / name)
    return {"checkpoints_equal": steps, **completed(resumed)}


def sigterm_resume(ctx: Context) -> dict[str, Any]:
    """SIGTERM at the first log line: one checkpoint, exit 75; the same command resumes and
    ends bitwise equal to the uninterrupted run."""
    m, exact = _exact(ctx)
    run = ctx.run_dir("sigterm")
    cmd = [sys.executable, "-m", DETERMINISTIC, *ctx.exp, *exact, f"trainer.max_steps={m}",
           f"hydra.run.dir={run}"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines = []
    watchdog = threading.Timer(CASE_TIMEOUT_S, proc.kill)  # a run that never logs a step
    watchdog.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if f"/{m} loss" in line:  # a step's log line: training is under way
                proc.send_signal(signal.SIGTERM)
                break
        rest, _ = proc.communicate(timeout=CASE_TIMEOUT_S)
    finally:
        watchdog.cancel()
    output = "".join(lines) + rest
    if proc.returncode != 75:
        raise CaseFailed(f"exit status {proc.returncode} after SIGTERM, not 75: "
                         f"{output.strip().splitlines()[-1:]}")
    stopped = json.loads((run / "summary.json").read_text())["global_step"]
    if not 0 < stopped < m:
        raise CaseFailed(f"stopped at step {stopped}, not inside the run")
    resumed = ctx.train("sigterm", *exact, f"trainer.max_steps={m}", module=DETERMINISTIC)
    diff = compare(_straight(ctx) / "checkpoints" / "last.pt", run / "checkpoints" / "last.pt")
    return {"stopped_at": stopped, "largest_weight_difference": diff, **completed(resumed)}


def explicit_device(ctx: Context) -> dict[str, Any]:
    """``trainer.device=cuda:N`` for the last GPU (cuda:0 on a one-GPU machine), async saves."""
    n = torch.cuda.device_count() - 1
    outcome = ctx.train("explicit_device", f"trainer.device=cuda:{n}", "trainer.max_steps=40",
                        "checkpoint.async_save=true", "checkpoint.every_n_steps=20")
    if f"on cuda:{n}" not in outcome["output"]:
        raise CaseFailed(f"the log does not say the run trained on cuda:{n}")
    for path in (outcome["run"] / "checkpoints").glob("*.pt"):
        if not all(torch.isfinite(t).all() for t in weights(path).values()
                   if t.is_floating_point()):
            raise CaseFailed(f"{path.name} holds non-finite weights")
    return {"device": f"cuda:{n}", **completed(outcome)}


def dataloader_prefetcher(ctx: Context) -> dict[str, Any]:
    """``data.loader=dataloader``: workers, pinned memory, the DevicePrefetcher, end to end."""
    pinned = ["data.pin_memory=true"] if ctx.cuda else []  # pinning needs CUDA
    return completed(ctx.train("dataloader", "data.loader=dataloader", "data.num_workers=4",
                               *pinned, "trainer.max_steps=40"))


def ddp_cpu_on_gpu_machine(ctx: Context) -> dict[str, Any]:
    """``torchrun --nproc-per-node=2 ... trainer.device=cpu``: gloo, no GPU touched."""
    outcome = ctx.train("ddp_cpu", "trainer.device=cpu", "trainer.precision=32",
                        "trainer.max_steps=10", exp=ctx.mnist, launcher=(
                            "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"))
    if outcome["summary"].get("world_size") != 2:
        raise CaseFailed(f"world size {outcome['summary'].get('world_size')}, not 2")
    return completed(outcome)


def nccl(ctx: Context) -> dict[str, Any]:
    """trainkit over NCCL with 2 processes: DDP's gradient all-reduce and the StepVote every
    step, then ``micro_batch_size=auto``'s vote (a real OOM above 8 samples on every rank), and
    NCCL with gloo in one group. A lent machine has one GPU: there the case is ``NOT RUN (needs
    2 GPUs)`` at once (NCCL refuses two ranks on one GPU), which does not fail a one-GPU verdict."""
    if torch.cuda.device_count() < 2:
        raise NotRun(NEEDS_2_GPUS)
    ddp = completed(_two_ranks(ctx, "nccl", "trainer.max_steps=20"))
    auto = _two_ranks(ctx, "nccl_auto", "model._target_=tests.helpers.models.BatchHungryNet",
                      "data.batch_size=32", "trainer.micro_batch_size=auto",
                      "trainer.max_steps=6", exp=ctx.mnist)
    if auto["summary"].get("micro_batch_size") != 8:
        raise CaseFailed(f"micro_batch_size=auto over NCCL settled at "
                         f"{auto['summary'].get('micro_batch_size')}, not 8")
    proc = subprocess.run([sys.executable, "-c", _COLLECTIVES], cwd=REPO, capture_output=True,
                          text=True, timeout=CASE_TIMEOUT_S)
    if proc.returncode != 0:
        raise CaseFailed(f"NCCL collectives: {(proc.stderr.strip().splitlines() or ['-'])[-1]}")
    return {"gpus": torch.cuda.device_count(), "collectives": proc.stdout.strip(),
            "micro_batch_size": 8, **ddp}


def _two_ranks(ctx: Context, name: str, *overrides: str,
               exp: list[str] | None = None) -> dict[str, Any]:
    """A world of 2 over NCCL: torchrun on 2 GPUs."""
    outcome = ctx.train(name, *overrides, exp=exp, launcher=(
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"))
    if outcome["summary"].get("world_size") != 2:
        raise CaseFailed(f"world size {outcome['summary'].get('world_size')}, not 2")
    return outcome


_COLLECTIVES = """
import torch, torch.distributed as dist
dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1, store=dist.HashStore(),
                        device_id=torch.device("cuda", 0))
on_gpu, on_cpu = torch.ones(4, device="cuda"), torch.ones(4)
dist.all_reduce(on_gpu)
dist.all_reduce(on_cpu)
dist.barrier()
assert on_gpu.sum().item() == 4 and on_cpu.sum().item() == 4
print("nccl", torch.cuda.nccl.version(), "and gloo collectives ok")
dist.destroy_process_group()
"""


def nonfinite_on_device(ctx: Context) -> dict[str, Any]:
    """A run that diverges (lr 1e30) with logging every 25 steps: the NaN/inf check of the steps
    between runs on the device, the streak is counted at the next read, the run stops as
    ``diverged`` (exit 2), and no checkpoint holds non-finite weights."""
    outcome = ctx.train("nonfinite", "optim.lr=1e30", "trainer.max_steps=60",
                        "trainer.nonfinite_patience=3", "trainer.log_every_n_steps=25",
                        "checkpoint.every_n_steps=10", expect=2)
    summary = outcome["summary"]
    if summary.get("status") != "diverged" or summary.get("nonfinite_steps", 0) < 3:
        raise CaseFailed(f"status {summary.get('status')!r} after "
                         f"{summary.get('nonfinite_steps')} NaN/inf steps, not 'diverged'")
    for path in (outcome["run"] / "checkpoints").glob("*.pt"):
        if not all(torch.isfinite(t).all() for t in weights(path).values()
                   if t.is_floating_point()):
            raise CaseFailed(f"{path.name} holds non-finite weights")
    return {k: summary[k] for k in ("status", "global_step", "nonfinite_steps", "skipped_steps")}


def _amp(ctx: Context, precision: str) -> dict[str, Any]:
    """A run at ``precision``: finite losses, few skipped steps, CUDA memory and (fp16 only) the
    loss scale in TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    outcome = ctx.train(f"amp_{precision}", f"trainer.precision={precision}",
                        "trainer.max_steps=100")
    result = completed(outcome)
    summary = outcome["summary"]
    events = EventAccumulator(str(outcome["run"] / "tb")).Reload()
    tags = events.Tags()["scalars"]
    losses = [e.value for e in events.Scalars("train/loss")]
    checks = {
        "finite losses": all(math.isfinite(v) for v in losses),
        "few skipped steps": summary["skipped_steps"] < summary["global_step"] // 2,
        "CUDA memory in TensorBoard": "memory/cuda_peak_allocated_gib" in tags,
        "loss scale iff fp16": ("amp/loss_scale" in tags) == (precision == "16-mixed"),
        "MFU in TensorBoard and 0 < mfu < 1": ("throughput/mfu" in tags
                                               and 0 < summary.get("mfu", 0) < 1),
    }
    failed = [name for name, held in checks.items() if not held]
    peak = peak_problem(summary, torch.cuda.get_device_name(0), precision)
    if peak:
        failed.append(peak)
    if failed:
        raise CaseFailed(f"{', '.join(failed)} (tags {sorted(tags)})")
    return {"skipped_steps": summary["skipped_steps"], "mfu": summary.get("mfu"),
            "peak_source": summary.get("peak_source"), **result}


def peak_problem(summary: dict[str, Any], device_name: str, precision: str) -> str | None:
    """What is wrong with a run's MFU denominator, or None: on a card in the table, the
    datasheet's dense figure for the run's precision (a 2x peak reads as half the MFU); on
    another, a measured peak at least the run's own TFLOP/s."""
    from trainkit.observe.peaks import datasheet_peak

    kind = {"bf16-mixed": "bf16", "16-mixed": "fp16"}[precision]
    expected = datasheet_peak(device_name, kind)
    got, source = summary.get("peak_tflops"), str(summary.get("peak_source", ""))
    if expected is not None:
        if got != expected[0] or source != f"datasheet: {expected[1]}":
            return (f"peak {got} TFLOP/s ({source}), not the datasheet's {expected[0]} "
                    f"({expected[1]}) for {device_name}")
        return None
    if not source.startswith("measured") or not got or got < summary.get("tflops", 0):
        return f"peak {got} TFLOP/s ({source}) for {device_name}, unlisted: not a measured peak"
    return None


def fp16_gradscaler(ctx: Context) -> dict[str, Any]:
    return _amp(ctx, "16-mixed")


def bf16(ctx: Context) -> dict[str, Any]:
    return _amp(ctx, "bf16-mixed")


def out_of_memory(ctx: Context) -> dict[str, Any]:
    """A real allocator OOM in the third step, the device's memory filled 1 GiB at a time until
    the allocator refuses (tests.helpers.models.fill_device): one line, status oom, the
    allocator's summary."""
    outcome = ctx.train("oom", "model._target_=tests.helpers.models.ExhaustingNet",
                        "trainer.max_steps=10", exp=ctx.mnist, expect=2)
    last = outcome["stderr"].strip().splitlines()[-1]
    log = (outcome["run"] / "train.log").read_text()
    checks = {
        "one short last line": len(last) <= 200 and "out of memory on cuda" in last,
        "status oom": outcome["summary"].get("status") == "oom",
        "allocator summary in train.log": "memory summary" in log.lower(),
    }
    failed = [name for name, held in checks.items() if not held]
    if failed:
        raise CaseFailed(f"{', '.join(failed)}; last line: {last}")
    return {"last_line": last}


def _fsdp_resume(ctx: Context, precision: str) -> dict[str, Any]:
    """``trainer.strategy=fsdp`` in one process at ``precision``, async saves: half the steps,
    then the same command resumes from the sharded checkpoint and completes."""
    name = f"fsdp_{precision}"
    args = ("trainer.strategy=fsdp", "checkpoint.async_save=true", "checkpoint.every_n_steps=10",
            "trainer.max_epochs=1000", "trainer.eval_every_n_epochs=1000",
            *([f"trainer.precision={precision}"] if ctx.cuda else []))
    ctx.train(name, *args, "trainer.max_steps=20")
    resumed = ctx.train(name, *args, "trainer.max_steps=40")
    if "at step 20" not in resumed["output"]:
        raise CaseFailed("the second run did not resume from step 20")
    return completed(resumed)


def fsdp_bf16_async_resume(ctx: Context) -> dict[str, Any]:
    return _fsdp_resume(ctx, "bf16-mixed")


def fsdp_fp16_async_resume(ctx: Context) -> dict[str, Any]:
    return _fsdp_resume(ctx, "16-mixed")


def dataloader_accumulation(ctx: Context) -> dict[str, Any]:
    """``data.loader=dataloader`` (workers, pinned memory, the prefetcher) with 4 batches per
    step: a window of batches the prefetcher already moved."""
    pinned = ["data.pin_memory=true"] if ctx.cuda else []
    return completed(ctx.train("dataloader_accumulation", "data.loader=dataloader",
                               "data.num_workers=2", *pinned,
                               "trainer.accumulate_grad_batches=4", "trainer.max_steps=20"))


def micro_batch_auto_and_profile(ctx: Context) -> dict[str, Any]:
    """A real allocator OOM above 8 samples, the device's memory filled each time:
    ``micro_batch_size=auto`` settles at 8 and completes only if each failed try's memory was
    released; the profiler's trace holds CUDA kernels, the memory snapshots are written (one
    at the out-of-memory error)."""
    outcome = ctx.train(
        "micro_batch", "model._target_=tests.helpers.models.BatchHungryNet", "data.batch_size=32",
        "trainer.micro_batch_size=auto", "trainer.max_steps=12", "trainer.profile.enabled=true",
        "trainer.profile.wait=2", "trainer.profile.warmup=1", "trainer.profile.active=2",
        "trainer.profile.memory_snapshot=true", exp=ctx.mnist)
    result = completed(outcome)
    folder = outcome["run"] / "profile"
    traces = sorted(folder.glob("rank0/trace_step*.json"))
    kernels = sum(e.get("cat") == "kernel" for t in traces
                  for e in json.loads(t.read_text())["traceEvents"])
    checks = {
        "micro_batch_size 8": outcome["summary"].get("micro_batch_size") == 8,
        "a trace with CUDA kernels": kernels > 0,
        "a memory snapshot at the OOM": (folder / "oom_rank0.pickle").is_file(),
        "a memory snapshot of the window": any(folder.glob("rank0/memory_step*.pickle")),
    }
    failed = [name for name, held in checks.items() if not held]
    if failed:
        raise CaseFailed(f"{', '.join(failed)}; files {sorted(map(str, folder.rglob('*')))}")
    return {"kernels_in_trace": kernels, **result}


def syncs(ctx: Context) -> dict[str, Any]:
    """``benchmarks.syncs``: host reads, host syncs and sync_debug_mode syncs grow with logs, not
    steps, over pre-placed batches and through the real image loader (decode cpu and gpu)."""
    from benchmarks.syncs import measure

    result = measure(torch.device(ctx.device))
    if result["failures"]:
        raise CaseFailed("; ".join(result["failures"]))
    return result


def throughput(ctx: Context) -> dict[str, Any]:
    """``benchmarks.gpu``: CIFAR-10 loaders, training speed per precision, the shaped run."""
    from benchmarks.gpu import main

    result = main(["--device", ctx.device, *([] if ctx.cuda else ["--quick"])])
    if "failed" in result["shaped_run"]:
        raise CaseFailed(f"the +exp=cifar run: {result['shaped_run']['failed']}")
    return result


def gpu_decode(ctx: Context) -> dict[str, Any]:
    """``data.decode=gpu`` (a batch of JPEG bytes per nvJPEG call) trains ``+exp=folder`` on
    photo-like JPEGs; its images/s against ``data.decode=cpu``, runs alternating."""
    from benchmarks.common import alternate, median, ratio

    root, files = _jpeg_folder(ctx.work / "jpegs", 1000)  # 40 steps of 128: several epochs
    exp = ["+exp=folder", f"data.root={root}", "data.num_workers=8",
           "data.batch_size=128", "trainer.max_steps=40", "trainer.log_every_n_steps=20"]
    outcomes: dict[str, dict[str, Any]] = {}

    def run(decode: str) -> float:
        name = f"decode_{decode}_{len(outcomes)}"  # cpu, gpu, gpu, cpu: a run dir each
        outcomes[name] = completed(ctx.train(name, f"data.decode={decode}", exp=exp))
        return float(outcomes[name]["samples_per_s"])

    samples = alternate({"cpu": lambda: run("cpu"), "gpu": lambda: run("gpu")}, rounds=1)
    return {"images_per_s": {side: median(samples, side) for side in samples},
            "gpu_over_cpu": ratio(samples, "gpu", "cpu"), "samples": samples,
            "gpu_run": outcomes["decode_gpu_2"], "files": files}


def _jpeg_folder(where: Path, count: int) -> tuple[Path, str]:
    """Photo-like JPEGs (:mod:`benchmarks.photos`), or without scikit-image smooth generated
    pictures at photo sizes (they decode faster than photographs: the ratio is the figure)."""
    from benchmarks.photos import photo_folder

    try:
        return photo_folder(count), "photo-like (benchmarks.photos)"
    except SystemExit as err:  # no scikit-image on this machine
        why = str(err)
    import numpy as np
    from PIL import Image

    from tests.image_files import picture

    rng = np.random.default_rng(0)
    for i in range(count):
        folder = where / f"class_{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(picture(rng, i % 10, 375, 500)).save(folder / f"{i}.jpg", quality=90)
    return where, f"generated 375x500 pictures ({why})"


# name -> (case, runs on the CPU too); in this order, the last three alone
CASES: dict[str, tuple[Case, bool]] = {
    "gpu_tests": (gpu_tests, False),
    "compile": (compile_, False),
    "activation_checkpointing": (activation_checkpointing, True),
    "compile_and_activation_checkpointing": (compile_and_activation_checkpointing, False),
    "async_save_resume": (async_save_resume, True),
    "sigterm_resume": (sigterm_resume, True),
    "explicit_device": (explicit_device, False),
    "dataloader_prefetcher": (dataloader_prefetcher, True),
    "ddp_cpu_on_gpu_machine": (ddp_cpu_on_gpu_machine, True),
    "nccl": (nccl, False),
    "nonfinite_on_device": (nonfinite_on_device, True),
    "fp16_gradscaler": (fp16_gradscaler, False),
    "bf16": (bf16, False),
    "out_of_memory": (out_of_memory, False),
    "fsdp_bf16_async_resume": (fsdp_bf16_async_resume, True),
    "fsdp_fp16_async_resume": (fsdp_fp16_async_resume, False),
    "dataloader_accumulation": (dataloader_accumulation, True),
    "micro_batch_auto_and_profile": (micro_batch_auto_and_profile, False),
    "gpu_decode": (gpu_decode, False),
    "syncs": (syncs, True),
    "throughput": (throughput, True),
}
ALONE = ("gpu_decode", "syncs", "throughput")  # timings: nothing else runs meanwhile

# Seconds each case is expected to take on one H100 (80 GB), run as its batch runs it: estimates
# from the cases' steps and processes until a lent machine's gpu_check.json (each case's
# "seconds") replaces them. The plan packs them into batches that each fit one device call.
EXPECTED_S: dict[str, int] = {
    "gpu_tests": 195, "compile": 90, "activation_checkpointing": 35,
    "compile_and_activation_checkpointing": 100, "async_save_resume": 90, "sigterm_resume": 70,
    "explicit_device": 35, "dataloader_prefetcher": 40, "ddp_cpu_on_gpu_machine": 40,
    "nccl": 1, "nonfinite_on_device": 35, "fp16_gradscaler": 45, "bf16": 45, "out_of_memory": 40,
    "fsdp_bf16_async_resume": 60, "fsdp_fp16_async_resume": 60, "dataloader_accumulation": 35,
    "micro_batch_auto_and_profile": 45, "gpu_decode": 90, "syncs": 75, "throughput": 150,
}
# One device call each (a lent machine: 10 minutes a call, 15 in all, one GPU): the timing
# cases in the second, alone (gpu_tests and syncs grew in round 8: the last parallel case moved
# to the first batch, which has room for it).
SECOND = ALONE
BATCHES: tuple[tuple[str, ...], ...] = (
    tuple(n for n in CASES if n not in SECOND),
    SECOND,
)
BATCH_LIMIT_S = 8 * 60  # a batch's expected seconds, at most (a call may run 10 minutes)
TOTAL_LIMIT_S = 14 * 60  # all batches' (a session's device time is 15 minutes)
SETUP_S = 40  # per batch: the Hydra wheels installed, the fake datasets written, CUDA started
CONTENTION = 1.5  # four runs at once share one GPU and the CPU cores: each takes this much longer
DEVICE_TIMEOUT_S = 570  # a device call's timeout_s for one batch (its limit is 600)


def batch_seconds(names: tuple[str, ...] | list[str], parallel: int = 4) -> float:
    """A batch's expected seconds: its parallel cases packed into ``parallel`` lanes (longest
    first, each into the least loaded), slowed by running together, then the timing cases one
    after another, and the setup."""
    lanes = [0.0] * max(1, parallel)
    for name in sorted((n for n in names if n not in ALONE), key=lambda n: -EXPECTED_S[n]):
        lanes[lanes.index(min(lanes))] += EXPECTED_S[name]
    together = max(lanes) * (CONTENTION if sum(v > 0 for v in lanes) > 1 else 1.0)
    return SETUP_S + together + sum(EXPECTED_S[n] for n in names if n in ALONE)


def plan() -> dict[str, Any]:
    """The batches with their cases' expected seconds and the device command for each."""
    batches = []
    for number, names in enumerate(BATCHES, start=1):
        command = f'bash benchmarks/gpu_check.sh --batch {number} "$OUT"'
        batches.append({
            "batch": number, "cases": {n: EXPECTED_S[n] for n in names},
            "expected_s": round(batch_seconds(names)),
            "device_call": {"command": command, "carry": [".whl"],
                            "timeout_s": DEVICE_TIMEOUT_S},
        })
    total = sum(b["expected_s"] for b in batches)
    return {"batches": batches, "total_s": total, "batch_limit_s": BATCH_LIMIT_S,
            "total_limit_s": TOTAL_LIMIT_S,
            "fits": all(b["expected_s"] <= BATCH_LIMIT_S for b in batches)
            and total <= TOTAL_LIMIT_S}


def print_plan(found: dict[str, Any]) -> None:
    for batch in found["batches"]:
        print(f"batch {batch['batch']}: expected {batch['expected_s']} s "
              f"({batch['expected_s'] / 60:.1f} min of at most {BATCH_LIMIT_S // 60})")
        for name, seconds in batch["cases"].items():
            print(f"  {name:<40}{seconds:>5} s{'  (alone)' if name in ALONE else ''}")
        call = batch["device_call"]
        print(f"  device call: run(command='{call['command']}', carry={json.dumps(call['carry'])}"
              f", timeout_s={call['timeout_s']})")
    print(f"total: expected {found['total_s']} s ({found['total_s'] / 60:.1f} min of at most "
          f"{TOTAL_LIMIT_S // 60}); {'fits' if found['fits'] else 'DOES NOT FIT'}; first, here: "
          "bash benchmarks/gpu_check.sh --fetch-wheels (makes .whl/); run the batches one after "
          "the other (a warm machine is not started again)")


class Recorder:
    """Each case's result as it ends, and ``gpu_check.json`` rewritten after every case (a call
    cut off at its limit still brings back what ran)."""

    def __init__(self, out: Path, device: str, batch: int | None) -> None:
        self.out, self.device, self.batch = out, device, batch
        self.cases: dict[str, dict[str, Any]] = {}
        self.started = time.perf_counter()
        self.lock = threading.Lock()

    def add(self, name: str, result: dict[str, Any]) -> None:
        with self.lock:
            self.cases[name] = result
            self.write()

    def write(self) -> dict[str, Any]:
        result = summarise(self.cases, self.device, time.perf_counter() - self.started)
        result["batch"] = self.batch
        self.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
        return result


def run_case(name: str, ctx: Context, recorder: Recorder | None = None) -> dict[str, Any]:
    case, on_cpu = CASES[name]
    if not ctx.cuda and not on_cpu:
        result: dict[str, Any] = {"ok": None, "skipped": "needs CUDA"}
    elif time.monotonic() >= ctx.deadline:
        result = {"ok": None, "not_run": "deadline", "seconds": 0.0}
    else:
        result = _timed_case(case, ctx)
    with _print_lock:
        if "seconds" in result:
            print(f"== {name}: {_status(result, ctx.cuda)} in {result['seconds']} s", flush=True)
            print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2,
                             default=str)[:6000], flush=True)
    if recorder is not None:
        recorder.add(name, result)
    return result


def _timed_case(case: Case, ctx: Context) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        result = {"ok": True, **case(ctx)}
    except NotRun as err:
        result = {"ok": None, "not_run": str(err)}
    except (CaseFailed, subprocess.TimeoutExpired) as err:
        result = {"ok": False, "error": str(err)}
    except Exception as err:  # a bug in the case itself: its traceback, the others still run
        result = {"ok": False, "error": one_line(err), "traceback": traceback.format_exc()}
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def _status(result: dict[str, Any], cuda: bool) -> str:
    """PASS, FAIL, ``NOT RUN (needs 2 GPUs)`` (not a failure), or (``--device cpu`` only)
    skipped: on a GPU any other case not run (the deadline passed, say) is a FAIL."""
    if result["ok"] is None:
        if result.get("not_run") == NEEDS_2_GPUS:
            return f"NOT RUN ({NEEDS_2_GPUS})"
        if not cuda and "not_run" not in result:
            return "skipped"
        return f"FAIL (not run{': ' + result['not_run'] if result.get('not_run') else ''})"
    return "PASS" if result["ok"] else "FAIL"


def cuda_missing() -> str | None:
    """Why this check cannot run on CUDA: None when torch sees a GPU; else a line that starts
    with FAIL when ``nvidia-smi`` lists a GPU torch cannot use (a broken torch or driver), or
    with skipped when the machine has none."""
    if torch.cuda.is_available():
        return None
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        listed = ""
    gpus = [line for line in listed.splitlines() if line.startswith("GPU ")]
    if not gpus:
        return "skipped: CUDA is not available on this machine"
    return (f"FAIL: nvidia-smi sees {len(gpus)} GPU(s) ({gpus[0][:80]}) but torch "
            f"{torch.__version__} (CUDA {torch.version.cuda}) cannot use CUDA")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, nargs="?", help="where gpu_check.json goes")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: the cases that can, on the CPU (for the tests)")
    parser.add_argument("--only", help="comma-separated case names (default: every case)")
    parser.add_argument("--batch", type=int, choices=range(1, len(BATCHES) + 1),
                        help="the cases of one batch of the plan (one device call)")
    parser.add_argument("--plan", action="store_true",
                        help="print the batches, their expected seconds and device commands")
    parser.add_argument("--deadline", type=float, default=BATCH_LIMIT_S,
                        help="seconds after which no case starts (a started one is cut then)")
    parser.add_argument("--parallel", type=int, default=4, help="cases run at once")
    args = parser.parse_args(argv)
    if args.plan:
        found = plan()
        print_plan(found)
        if not found["fits"]:
            sys.exit(1)
        return found
    if args.out_dir is None:
        parser.error("give out_dir (or --plan)")
    if args.only and args.batch:
        parser.error("give --only or --batch, not both")
    names = ([n.strip() for n in args.only.split(",") if n.strip()] if args.only
             else list(BATCHES[args.batch - 1]) if args.batch else list(CASES))
    unknown = set(names) - set(CASES)
    if unknown:
        parser.error(f"unknown case(s) {', '.join(sorted(unknown))}; have {', '.join(CASES)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "gpu_check.json"
    missing = cuda_missing() if args.device == "cuda" else None
    if missing is not None:
        result: dict[str, Any] = {"skipped" if missing.startswith("skipped") else "failed":
                                  missing}
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"gpu_check: {missing}")
        if "failed" in result:
            sys.exit(1)
        return result
    recorder = Recorder(out, args.device, args.batch)
    deadline = time.monotonic() + args.deadline
    work = Path(tempfile.mkdtemp(prefix="trainkit-gpu-check-"))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        ctx = Context(work, args.device, deadline)
        together = [n for n in names if n not in ALONE]
        with ThreadPoolExecutor(max_workers=args.parallel) as pool:
            list(pool.map(lambda n: run_case(n, ctx, recorder), together))
        for name in names:
            if name in ALONE:
                run_case(name, ctx, recorder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = recorder.write()
    print_summary(result, out)
    if result["failed"]:
        sys.exit(1)
    return result


def summarise(cases: dict[str, dict[str, Any]], device: str, seconds: float) -> dict[str, Any]:
    """The JSON's head: versions, and each case's status (on CUDA a case not run failed, but
    for one that needs 2 GPUs on a machine with one)."""
    cuda = device == "cuda"
    status = {n: _status(r, cuda) for n, r in cases.items()}
    return {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "seconds": round(seconds, 1),
        "status": status,
        "passed": [n for n, s in status.items() if s == "PASS"],
        "failed": [n for n, s in status.items() if s.startswith("FAIL")],
        "not_run": [n for n, s in status.items() if s.startswith("NOT RUN")],
        "skipped": [n for n, s in status.items() if s == "skipped"],
        "cases": cases,
    }


def print_summary(result: dict[str, Any], out: Path) -> None:
    """Every case with PASS/FAIL, then one line with the counts and the versions."""
    width = max(map(len, result["status"]), default=0)
    for name, status in result["status"].items():
        error = result["cases"][name].get("error", "")
        print(f"{name:<{width}}  {status}" + (f"  {error.splitlines()[0][:150]}" if error
                                              else ""))
    not_run = f", {len(result['not_run'])} not run ({NEEDS_2_GPUS})" if result["not_run"] else ""
    print(f"gpu_check: {len(result['passed'])} passed, {len(result['failed'])} failed "
          f"({', '.join(result['failed']) or 'none'}){not_run}, {len(result['skipped'])} "
          f"skipped, in "
          f"{result['seconds']} s; torch {result['torch']}, CUDA {result['cuda']}, "
          f"{result['device']} x{result['gpus']}; results in {out}")


if __name__ == "__main__":
    main()
