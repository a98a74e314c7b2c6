"""``trainkit probe +exp=cifar [overrides]``: what holds a run back, measured in a few seconds.

The same config and overrides as ``trainkit train`` build the same loader, model and optimizer
(:func:`trainkit.entry.build.build_parts`); then three timed phases, each after a warm-up
(:mod:`trainkit.loop.throughput`): the **loader** alone (batches/s on the device), the **step**
alone (one batch kept on the device), and **together** as ``fit`` runs them.

It prints one table, the model's FLOPs per sample with the MFU of the step alone and together
(:mod:`trainkit.observe.flops`; on a CPU against a matmul measured here), and one verdict line:
input-bound (with the loader re-measured with twice the workers, and in memory) or
compute-bound (with its MFU and the memory a larger batch could use). It writes the figures to
``probe.json`` (``--out PATH``) and nothing else. Under torchrun every rank measures its share;
rank 0 prints. Exit status 0, or 2 on bad input (one line). Guide: docs/gpu-idle.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir

from trainkit.config import TrainConfig
from trainkit.core.cuda_settings import apply_device_settings, use_device
from trainkit.core.device import GIB
from trainkit.core.errors import TrainkitError
from trainkit.core.rng import seed_everything
from trainkit.core.runtime import Runtime
from trainkit.data import default_num_workers, source_of
from trainkit.distributed import group, strategy
from trainkit.entry.build import build_data, build_parts, build_settings
from trainkit.entry.errors import errors_as_one_line
from trainkit.entry.train import CONFIG_DIR
from trainkit.loop import throughput
from trainkit.loop.activations import apply_activation_checkpointing
from trainkit.loop.precision import Precision
from trainkit.loop.step import WindowStep
from trainkit.loop.throughput import Phase
from trainkit.models.param_groups import apply_freeze
from trainkit.observe.flops import FlopsMeter, measure_matmul_tflops
from trainkit.observe.logging import setup_logging
from trainkit.observe.peaks import compute_kind

INPUT_WAIT = 0.15  # a data-wait share of the together phase that makes a run input-bound
SMALL_MFU = 0.3  # compute-bound below this MFU with memory to spare: the batch is too small


def main(argv: list[str] | None = None) -> int:
    """Run ``trainkit probe``; return its exit status."""
    parser = argparse.ArgumentParser(
        prog="trainkit probe", description="Measure the loader, the step and both together; "
        "say which one holds the run back. Guide: docs/gpu-idle.md")
    parser.add_argument("--seconds", type=float, default=3.0,
                        help="timed seconds of each phase, after its warm-up (default 3)")
    parser.add_argument("--out", type=Path, default=Path("probe.json"),
                        help="where the figures go (default: probe.json in this folder)")
    parser.add_argument("overrides", nargs="*", help="the overrides you pass to trainkit train")
    args = parser.parse_intermixed_args(argv)  # options before, between or after overrides
    with errors_as_one_line():
        if not args.seconds > 0:
            raise TrainkitError(f"--seconds must be > 0, got {args.seconds}")
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cfg = compose("train", overrides=args.overrides)
        report = probe(cfg, seconds=args.seconds)
        if report is not None:  # rank 0
            _write(args.out, {"overrides": args.overrides, **report})
            print(f"figures: {args.out}")
    group.shutdown()
    return 0


def probe(cfg: Any, *, seconds: float) -> dict[str, Any] | None:
    """Measure the run ``cfg`` describes; print the table and verdict on rank 0, return them.

    Other ranks measure too (a step all-reduces) and return None.
    """
    settings = build_settings(cfg)
    runtime = Runtime.from_env(settings.trainer.device)
    use_device(runtime.device)
    group.init_process_group(runtime)
    setup_logging(None, runtime.is_main)  # warnings to the console; no train.log
    seed_everything(settings.trainer.seed)
    parts = build_parts(cfg, settings, runtime)
    apply_device_settings(settings.trainer, runtime.device)  # the run's process settings
    step, flops = _window_step(settings.trainer, runtime, parts)
    guard = settings.trainer.nonfinite_patience > 0
    phases = [throughput.loader_phase(parts.train_data, runtime.device, seconds=seconds)]
    first = next(throughput.cycle(parts.train_data))
    flops.watch(step.model)  # counted in the step phase's warm-up, on a meta copy
    phases.append(throughput.step_phase(step, first, seconds=seconds, guard_finite=guard))
    phases.append(throughput.together_phase(
        step, parts.train_data, accumulate=settings.trainer.accumulate_grad_batches,
        seconds=seconds, guard_finite=guard))
    ranks = group.all_gather([p.as_dict() for p in phases])
    loader, alone, together = phases
    bound = "input" if _input_bound(*(Phase(**p) for p in ranks[0])) else "compute"
    variants = _variants(cfg, settings, runtime, seconds) if bound == "input" else []
    if not runtime.is_main:
        return None
    mfu = _mfu(flops, runtime, alone, together)
    line = (_input_verdict(_in_memory(cfg, settings), runtime, loader, alone, together, variants)
            if bound == "input" else _compute_verdict(settings, runtime, alone, together, mfu))
    if mfu.get("together") is not None:  # "compute-bound: MFU 38%; ..."
        bound_word, rest = line.split(": ", 1)
        line = f"{bound_word}: MFU {mfu['together']:.0%}; {rest}"
    print(_table(settings, runtime, seconds, phases, variants, ranks))
    print(_flops_lines(mfu))
    print(f"verdict: {line}", flush=True)
    return {"device": str(runtime.device), "world_size": runtime.world_size,
            "batch_size": settings.data.batch_size, "seconds": seconds,
            "phases": [p.as_dict() for p in phases], "ranks": ranks, "variants": variants,
            "flops": mfu, "verdict": {"bound": bound, "line": line}}


def _step_alone_rate(alone: Phase, together: Phase) -> float:
    """The step alone's samples/s, steady: at least the together phase's (which runs the same
    step and loads too), so a busy moment in the step phase never makes a ratio above 100%."""
    return max(alone.samples_per_s, together.samples_per_s)


def _mfu(flops: FlopsMeter, runtime: Runtime, alone: Phase, together: Phase) -> dict[str, Any]:
    """FLOPs per sample, the peak, the matmul measured here (the machine's best), and the MFU
    of the step alone and of the two together (None where the FLOPs could not be counted, or
    where a rate reached the peak: never a figure of 100% or more)."""
    kind = compute_kind(flops.precision, runtime.device)
    out: dict[str, Any] = {"kind": kind,
                           "matmul_tflops": measure_matmul_tflops(runtime.device, kind)}
    if flops.per_sample is not None and flops.peak is not None:
        rates = {"alone": _step_alone_rate(alone, together), "together": together.samples_per_s}
        for name, samples_per_s in rates.items():
            found = flops.rates(samples_per_s)
            out[name] = found.get("throughput/mfu")
            out[f"{name}_tflops"] = found["throughput/tflops"]
        out.update(flops.summary())  # the peak as the rates left it
    return out


def _flops_lines(mfu: dict[str, Any]) -> str:
    """The table's FLOPs lines: the model's per sample, the peak, the matmul measured here
    (advised as ``trainer.peak_tflops`` only where it is above the step's own rate)."""
    matmul = f"matmul ({mfu['kind']}) measured here: {mfu['matmul_tflops']:.4g} TFLOP/s"
    if mfu["matmul_tflops"] > mfu.get("alone_tflops", 0.0):
        matmul += f" (for runs: trainer.peak_tflops={mfu['matmul_tflops']:.4g})"
    else:
        matmul += " (below the step's own rate: not a peak to pin)"
    if "flops_per_sample" not in mfu:
        return f"FLOPs not counted (see the line above); {matmul}"
    return (f"model: {mfu['flops_per_sample'] / 1e9:.4g} GFLOP per sample (forward + backward); "
            f"peak {mfu['peak_tflops']:.4g} TFLOP/s ({mfu['peak_source']}); MFU step alone "
            f"{_share(mfu['alone'])}, together {_share(mfu['together'])}\n{matmul}")


def _share(mfu: float | None) -> str:
    return "- (at the peak: see the line above)" if mfu is None else f"{mfu:.1%}"


def _window_step(cfg: Any, runtime: Runtime, parts: Any) -> tuple[WindowStep, FlopsMeter]:
    """fit's step on the model prepared as fit prepares it (trainer.freeze, activation
    checkpointing, then the strategy: device, DDP/FSDP, compile), and its FLOPs meter."""
    precision = Precision(cfg.precision, runtime.device)
    apply_freeze(parts.model, cfg, 0)  # trainer.freeze: the first epoch's step
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(parts.model, cfg.activation_checkpointing)
    flops = FlopsMeter(parts.model, runtime.device, precision.mode, cfg.peak_tflops)
    model = strategy.prepare_model(parts.model, parts.optimizer, cfg, runtime, precision.mode)
    model = strategy.compiled(model, cfg.compile) if cfg.compile else model
    model.train()
    return WindowStep(model, optimizer=parts.optimizer, precision=precision,
                      criterion=parts.criterion, forward=parts.forward,
                      device=runtime.device, clip_val=cfg.gradient_clip_val,
                      clip_algorithm=cfg.gradient_clip_algorithm), flops


def _input_bound(loader: Phase, alone: Phase, together: Phase) -> bool:
    """Waiting for data in the together phase, or a loader slower than the step it feeds."""
    return (together.data_wait_share or 0.0) >= INPUT_WAIT or (
        loader.samples_per_s < 0.9 * alone.samples_per_s)


def _in_memory(cfg: Any, settings: TrainConfig) -> bool:
    """Whether the run loads through the in-memory loader (``data.loader`` is read by the
    built-in tensor datasets and a reader of your own only)."""
    own = cfg.get("dataset") is not None
    return settings.data.loader == "memory" and (
        own or source_of(settings.data.name).in_memory)


def _variants(cfg: Any, settings: TrainConfig, runtime: Runtime, seconds: float
              ) -> list[dict[str, Any]]:
    """The loader alone again with twice the workers, and in memory: what each gave."""
    data = settings.data
    tries: list[tuple[str, Any]] = []
    if not _in_memory(cfg, settings):
        workers = data.num_workers if data.num_workers is not None else default_num_workers()
        more = max(2, 2 * workers)
        tries.append((f"data.num_workers={more}", dataclasses.replace(data, num_workers=more)))
        own = cfg.get("dataset") is not None
        if source_of(data.name, own_reader=own).in_memory:  # files, streams: none to try
            tries.append(("data.loader=memory", dataclasses.replace(data, loader="memory")))
    measured = []
    for setting, changed in tries:
        try:
            train_data = build_data(cfg, dataclasses.replace(settings, data=changed), runtime)[0]
        except (TrainkitError, torch.cuda.OutOfMemoryError) as err:  # it does not fit, say so
            measured.append({"setting": setting, "error": str(err).splitlines()[0][:120]})
            continue
        phase = throughput.loader_phase(train_data, runtime.device, seconds=seconds,
                                        name=setting)
        measured.append({"setting": setting, "samples_per_s": phase.samples_per_s})
        del train_data  # its workers end before the next try starts its own
    return measured


def _input_verdict(in_memory: bool, runtime: Runtime, loader: Phase, alone: Phase,
                   together: Phase, variants: list[dict[str, Any]]) -> str:
    wait = together.data_wait_share or 0.0
    text = (f"input-bound: {together.samples_per_s:.0f} samples/s together, the step alone "
            f"takes {alone.samples_per_s:.0f} ({alone.samples_per_s / together.samples_per_s:.1f}x"
            f"); it waits for data {wait:.0%} of the time, the loader alone gives "
            f"{loader.samples_per_s:.0f}")
    tried = [v for v in variants if "samples_per_s" in v]
    for v in variants:
        text += (f"; {v['setting']}: loader {v['samples_per_s']:.0f} "
                 f"({v['samples_per_s'] / loader.samples_per_s:.1f}x)" if "samples_per_s" in v
                 else f"; {v['setting']}: not possible ({v['error']})")
    if tried:
        best = max(tried, key=lambda v: v["samples_per_s"])
        expect = min(best["samples_per_s"], alone.samples_per_s)
        return text + f"; fastest: {best['setting']} (up to ~{expect:.0f} samples/s together)"
    if in_memory:
        return text + ("; the in-memory loader's gather and augmentation run per batch: try a "
                       "larger data.batch_size")
    return text + "; try more loader workers and pinned memory"


def _compute_verdict(settings: TrainConfig, runtime: Runtime, alone: Phase,
                     together: Phase, mfu: dict[str, Any]) -> str:
    step_alone = _step_alone_rate(alone, together)
    text = (f"compute-bound: {together.samples_per_s:.0f} samples/s together is "
            f"{together.samples_per_s / step_alone:.0%} of the step alone "
            f"({step_alone:.0f}); data wait {together.data_wait_share or 0.0:.0%}")
    total, batch = throughput.device_memory_gib(runtime.device), settings.data.batch_size
    if runtime.device.type != "cuda":
        return text + (f"; memory {alone.peak_gib:.2f} GiB of the machine's {total:.0f} GiB: on "
                       "a CPU a larger batch seldom adds samples/s, a GPU or more cores do")
    rest = torch.cuda.memory_allocated(runtime.device) / GIB  # weights, optimizer state
    per_batch = max(alone.peak_gib - rest, 1e-6)
    fits = int(batch * max(0.0, 0.9 * total - rest) / per_batch)
    room = (f"a batch of about {fits} would fit in 90% of it (now {batch})" if fits > batch
            else "no room for a larger batch")
    text += f"; peak memory {alone.peak_gib:.1f} of {total:.0f} GiB: {room}"
    if (mfu.get("together") or 1.0) < SMALL_MFU and fits > batch:
        return text + "; the model is small for this GPU: raise the batch"
    return text


def _table(settings: TrainConfig, runtime: Runtime, seconds: float, phases: list[Phase],
           variants: list[dict[str, Any]], ranks: list[list[dict[str, Any]]]) -> str:
    where = "of the GPU" if runtime.device.type == "cuda" else "of RAM"
    lines = [f"trainkit probe: {runtime.device}, {runtime.world_size} process(es), batch "
             f"{settings.data.batch_size} a process, {seconds:g} s a phase",
             f"{'phase':<26}{'samples/s':>11}{'steps/s':>9}{'data wait':>11}  peak memory"]
    for p in phases:
        wait = "-" if p.data_wait_share is None else f"{p.data_wait_share:.0%}"
        lines.append(f"{p.name:<26}{p.samples_per_s:>11.0f}{p.steps_per_s:>9.1f}{wait:>11}  "
                     f"{p.peak_gib:.2f} GiB ({p.peak_share:.0%} {where})")
    for v in variants:
        figure = f"{v['samples_per_s']:>11.0f}" if "samples_per_s" in v else f"{'-':>11}"
        lines.append(f"{'loader, ' + v['setting']:<26}{figure}")
    if len(ranks) > 1:
        each = ", ".join(f"{r[2]['samples_per_s']:.0f}" for r in ranks)
        lines.append(f"together per rank (samples/s): {each}")
    return "\n".join(lines)


def _write(path: Path, report: dict[str, Any]) -> None:
    try:
        path.write_text(json.dumps(report, indent=2) + "\n")
    except OSError as err:
        raise TrainkitError(f"--out {path}: cannot write there ({err.strerror}); give a path "
                            "in a folder you can write to") from None


if __name__ == "__main__":
    raise SystemExit(main())
