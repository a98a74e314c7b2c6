"""A run's FLOPs per sample and its model FLOPs utilisation (MFU).

Counted once, at the first training step, by :class:`torch.utils.flop_counter.FlopCounterMode`:
a forward pre-hook catches the call's shapes, and a ``meta`` copy of the model (taken after
activation checkpointing, before DDP/FSDP) runs that call and a backward under the counter --
no memory, no arithmetic, no random draw, so weights, RNG streams and resumes are unchanged.
A checkpointed block's recomputation is counted apart: MFU uses the model's FLOPs (forward +
backward, as PaLM defines it); ``throughput/hfu`` adds the recomputation.

MFU divides the achieved TFLOP/s by the device's peak for the run's precision: the datasheet's
(:mod:`trainkit.observe.peaks`), else the machine's best measured matmul (a CPU, a card missing
from the table), or ``trainer.peak_tflops``. A window at or above its peak reports no MFU (a
figure above 100% is never printed): a measured peak is then raised to that window's rate, which
the machine has shown it reaches.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from trainkit.core.tree import tensors, tree_map
from trainkit.observe.peaks import best_known, compute_kind, datasheet_peak, machine_key

log = logging.getLogger("trainkit")
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
          "fp16": torch.float16}
_measured: dict[tuple[str, str, int], float] = {}  # (device, kind, threads) -> TFLOP/s


class FlopCount(NamedTuple):
    """FLOPs of one training step on one batch."""

    model: int  # forward + backward
    recompute: int  # activation checkpointing's forward again, in backward


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers live on the ``meta`` device (no memory
    and no copy of the weights); hooks and patched forwards (activation checkpointing) come
    along."""
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        meta = torch.empty_like(tensor, device="meta")
        if isinstance(tensor, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = meta
    return copy.deepcopy(model, memo)


def count_call(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> FlopCount:
    """The FLOPs of ``model(*args, **kwargs)`` and a backward from its outputs, on ``model`` (a
    :func:`meta_copy`) with the arguments' tensors as meta tensors of the same shapes.

    The backward starts from the sum of the outputs: a matmul's gradients cost the same whatever
    the loss (a loss function's own FLOPs, no matmuls, are not counted). A recomputation is an
    operation run with gradients enabled during the backward (the backward's own run without):
    it is counted into ``recompute``.
    """
    phase = {"backward": False, "recompute": 0}

    def tallied(formula: Callable[..., int]) -> Callable[..., int]:
        def flops(*args: Any, **kwargs: Any) -> int:
            count = formula(*args, **kwargs)
            if phase["backward"] and torch.is_grad_enabled():
                phase["recompute"] += count
            return count
        return flops

    # the registry's formulas take shapes; FlopCounterMode wraps custom ones to give them shapes
    custom = {op: tallied(getattr(f, "__wrapped__", f)) for op, f in flop_registry.items()}
    args, kwargs = tree_map(_to_meta, (args, kwargs))
    # gradients on even where the call was made without (a frozen teacher's, say): its FLOPs
    with torch.enable_grad(), FlopCounterMode(display=False, custom_mapping=custom) as counter:
        outputs = [t for t in tensors(model(*args, **kwargs)) if t.requires_grad]
        phase["backward"] = True
        if outputs:
            torch.stack([t.float().sum() for t in outputs]).sum().backward()
    recompute = int(phase["recompute"])
    return FlopCount(int(counter.get_total_flops()) - recompute, recompute)


def _to_meta(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(tensor, device="meta").requires_grad_(tensor.requires_grad)


ROUNDS = 5  # at most, of the matmul measurement: until a round no longer beats the best by 5%


def measure_matmul_tflops(device: torch.device, kind: str = "fp32",
                          seconds: float = 0.2) -> float:
    """The machine's best TFLOP/s of square matmuls in ``kind``'s dtype on ``device``.

    A round times growing sizes (a CPU's cache favours smaller ones, a GPU's width larger ones)
    within about ``seconds``; rounds repeat while one still beats the best by 5% (a machine
    busy for a moment), and the figure is the larger of theirs and the best kept for this
    machine, device, kind and CPU thread count across runs (:func:`~trainkit.observe.peaks.
    best_known`). Measured once per process, then remembered.

    The operands come from a generator of their own: the global RNG streams are untouched.
    """
    key = (str(device), kind, torch.get_num_threads())
    if key not in _measured:
        best = 0.0
        for _ in range(ROUNDS):
            this = _matmul_round(device, kind, seconds)
            improved = this > 1.05 * best
            best = max(best, this)
            if not improved:
                break
        _measured[key] = best_known(machine_key(device, kind), best)
    return _measured[key]


def _matmul_round(device: torch.device, kind: str, seconds: float) -> float:
    sizes = (256, 512, 1024, 2048) if device.type == "cpu" else (2048, 4096, 8192)
    best = 0.0
    for size in sizes:
        took = _best_matmul_seconds(device, DTYPES[kind], size, seconds / len(sizes))
        best = max(best, 2 * size ** 3 / took / 1e12)
        if 8 * took > seconds / len(sizes) / 3:  # the next size (8x the work): < 3 would fit
            break
    return best


def _raise_measured(device: torch.device, kind: str, tflops: float) -> float:
    """A rate the machine reached, above its measured peak: the new peak, here and kept."""
    key = (str(device), kind, torch.get_num_threads())
    _measured[key] = best_known(machine_key(device, kind), tflops)
    return _measured[key]


def _best_matmul_seconds(device: torch.device, dtype: torch.dtype, size: int,
                         budget: float) -> float:
    """The fastest of the ``size``-square matmuls that fill ``budget`` s (>= 2, after a warm-up)."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator).to(device, dtype) for _ in range(2))
    best, spent, repeat = float("inf"), 0.0, 0
    while repeat < 3 or spent < budget:
        _sync(device)
        start = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        took = time.perf_counter() - start
        if repeat:  # the first is the warm-up
            best, spent = min(best, took), spent + took
        repeat += 1
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_peak(device: torch.device, precision: str,
                override: float | None = None) -> tuple[float, str]:
    """``(peak TFLOP/s, where the figure comes from)`` for a run in ``precision`` on ``device``:
    ``override`` (``trainer.peak_tflops``), the datasheet table, or a measured matmul."""
    kind = compute_kind(precision, device)
    if override is not None:
        return float(override), f"trainer.peak_tflops ({kind})"
    if device.type == "cuda":
        found = datasheet_peak(torch.cuda.get_device_name(device), kind)
        if found is not None:
            return found[0], f"datasheet: {found[1]}"
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    return measure_matmul_tflops(device, kind), f"measured: {kind} matmul on {device.type}{threads}"


class FlopsMeter:
    """Counts a run's FLOPs per sample once and turns samples/s into TFLOP/s and MFU.

    Args:
        model: the model as the loop prepared it before DDP/FSDP (copied to ``meta`` here).
        device, precision: where and how the run computes (``Precision.mode``).
        peak_tflops: ``trainer.peak_tflops``; None: from the table or measured.

    Example:
        >>> meter = FlopsMeter(model, torch.device("cpu"), "32")  # doctest: +SKIP
        >>> meter.watch(model)  # the first step's call is counted  # doctest: +SKIP
        >>> meter.rates(samples_per_s=512.0)["throughput/mfu"]  # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, device: torch.device, precision: str,
                 peak_tflops: float | None = None) -> None:
        self.device, self.precision, self.override = device, precision, peak_tflops
        try:
            self._copy: nn.Module | None = meta_copy(model)
        except Exception as err:  # any model deepcopy cannot copy: no MFU, and a line why
            self._copy = None
            log.info("FLOPs not counted: the model cannot be copied to the meta device (%s)",
                     _first_line(err))
        self.per_sample: FlopCount | None = None
        self.peak: tuple[float, str] | None = None
        self.count_seconds = 0.0  # spent counting, left out of the step timing
        self.counted_s = 0.0  # the same, in all (never popped): the first step's timer reads it
        self._samples, self._seconds = 0, 0.0  # over the logged windows, for the summary
        self._handle: Any = None  # watch()'s hook, until the model's first call
        self._said_above = False  # the line about a window above its peak, once

    @classmethod
    def of(cls, model: nn.Module, precision: Any, peak_tflops: float | None = None
           ) -> FlopsMeter:
        """The meter of a run with ``precision`` (a :class:`~trainkit.loop.precision.Precision`:
        its ``device`` and ``mode``)."""
        return cls(model, precision.device, precision.mode, peak_tflops)

    def watch(self, model: nn.Module) -> FlopsMeter:
        """Count the FLOPs at ``model``'s next call (the run's first step), once.

        A forward pre-hook, removed at its first call (or by :meth:`finish`), catches the shapes
        of the call's arguments and counts them on the meta copy; the call then runs as it
        would have. ``model``: the module the step calls (DDP, FSDP or compiled, as it is).
        Returns this meter (for a :class:`~trainkit.observe.metrics.StepMeter`'s ``flops``).
        """
        if self._copy is None:
            return self

        def catch(module: nn.Module, args: Any, kwargs: Any) -> None:
            self.finish_watching()
            shapes = tree_map(_to_meta, (args, kwargs))
            first = next(tensors(shapes), None)
            if first is None or not first.dim():
                self._copy = None
                log.info("FLOPs not counted: the model's first argument has no batch dimension")
                return
            self.count(*shapes, samples=first.shape[0])

        # prepend: before any pre-hook already there, as fully_shard's, which casts the inputs
        # to its param_dtype (bf16 inputs would not run on the float32 meta copy)
        self._handle = model.register_forward_pre_hook(catch, with_kwargs=True, prepend=True)
        return self

    def finish_watching(self) -> None:
        """Remove :meth:`watch`'s hook if it is still there (a fit that took no step)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def count(self, args: tuple[Any, ...], kwargs: dict[str, Any], samples: int
              ) -> FlopCount | None:
        """Count the FLOPs of the model called with ``args`` and ``kwargs`` (a batch of
        ``samples``) and find the peak: once; later calls return the first count."""
        if self._copy is None:
            return self.per_sample
        started, model, self._copy = time.perf_counter(), self._copy, None
        try:
            total = count_call(model, args, kwargs)
        except Exception as err:  # a model that needs real values: no MFU, and a line why
            log.info("FLOPs not counted, so no throughput/tflops or MFU: %s", _meta_refusal(err))
        else:
            self.per_sample = FlopCount(total.model // samples, total.recompute // samples)
            self.peak = device_peak(self.device, self.precision, self.override)
        took = time.perf_counter() - started
        self.count_seconds += took
        self.counted_s += took
        return self.per_sample

    def pop_count_seconds(self) -> float:
        """Seconds spent counting since the last call: a meter leaves them out of its window."""
        seconds, self.count_seconds = self.count_seconds, 0.0
        return seconds

    def window(self, samples: int, seconds: float) -> dict[str, float]:
        """A logging window's rates (see :meth:`rates`), also added to the run's totals."""
        self._samples, self._seconds = self._samples + samples, self._seconds + seconds
        return self.rates(samples / seconds) if seconds > 0 else {}

    def rates(self, samples_per_s: float) -> dict[str, float]:
        """``throughput/tflops`` (model FLOPs), ``throughput/mfu`` (a fraction of the peak) and,
        with activation checkpointing, ``throughput/hfu`` (recomputation included)."""
        if self.per_sample is None or self.peak is None:
            return {}
        tflops = self.per_sample.model * samples_per_s / 1e12
        hardware = tflops + self.per_sample.recompute * samples_per_s / 1e12
        rates = {"throughput/tflops": tflops}
        if hardware >= self.peak[0]:  # not this machine's peak: no figure of 100% or more
            self._above_peak(hardware)
            return rates
        rates["throughput/mfu"] = tflops / self.peak[0]
        if self.per_sample.recompute:
            rates["throughput/hfu"] = hardware / self.peak[0]
        return rates

    def _above_peak(self, tflops: float) -> None:
        """A rate at or above the peak: a measured peak rises to it (the machine reached it);
        a datasheet's or ``trainer.peak_tflops`` stays, with one line saying so."""
        peak, source = self.peak or (0.0, "")
        if source.startswith("measured"):
            kind = compute_kind(self.precision, self.device)
            self.peak = (max(peak, _raise_measured(self.device, kind, tflops)), source)
            why = (f"the measured peak ({peak:.4g}) is below what this machine reaches (a "
                   "busy moment): raised to that rate, here and for later runs")
        else:
            why = f"the peak ({peak:.4g}, {source}) is too low for this device and precision"
        if not self._said_above:
            self._said_above = True
            log.info("MFU left out of a window that ran at %.4g TFLOP/s: %s", tflops, why)

    def summary(self) -> dict[str, Any]:
        """summary.json's figures: FLOPs per sample, the peak and where it comes from, and the
        TFLOP/s and MFU over the logged training windows (evaluation and checkpoints left out);
        empty when nothing was counted. The fit is over: :meth:`watch`'s hook goes."""
        self.finish_watching()
        if self.per_sample is None or self.peak is None:
            return {}
        out: dict[str, Any] = {"flops_per_sample": self.per_sample.model,
                               "peak_tflops": self.peak[0], "peak_source": self.peak[1]}
        if self.per_sample.recompute:
            out["recompute_flops_per_sample"] = self.per_sample.recompute
        if self._seconds > 0:
            rates = self.rates(self._samples / self._seconds)
            out["tflops"] = rates["throughput/tflops"]
            if "throughput/mfu" in rates:  # under 1, or left out
                out["mfu"] = rates["throughput/mfu"]
            out["peak_tflops"] = self.peak[0]  # raised, where a window showed more
        return out


def mfu_text(summary: dict[str, Any]) -> str:
    """``"MFU 38% (376 of 989.5 TFLOP/s, datasheet: H100 SXM bf16)"``; "" without figures."""
    if "mfu" not in summary:
        return ""
    return (f"MFU {summary['mfu']:.0%} ({summary['tflops']:.3g} of {summary['peak_tflops']:.4g} "
            f"TFLOP/s, {summary['peak_source']})")


def _meta_refusal(err: BaseException) -> str:
    """Why the count on meta tensors failed, in words: most often a forward that reads a value
    of its input (transformers' attention-mask checks), which a meta tensor does not have."""
    if "item()" in str(err) or "data-dependent" in str(err).lower():
        return ("the model's forward reads values of its inputs (Tensor.item()), and they are "
                "counted on shapes alone")
    return f"the model does not run on meta tensors ({_first_line(err)})"


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:120]}" if text else type(err).__name__
