"""Meters that accumulate on the device and are read only when logged."""

from __future__ import annotations

import os
import resource
import sys
import time

import psutil
import torch

from trainkit.core.device import GIB, memory_stats
from trainkit.observe.flops import FlopsMeter

_processes: dict[int, psutil.Process] = {}
_statm: dict[int, int] = {}  # pid -> an open /proc/<pid>/statm, -1 where there is none


def _this_process() -> psutil.Process:
    """This process's psutil handle, made once per process (a fork gets its own)."""
    pid = os.getpid()
    if pid not in _processes:
        _processes[pid] = psutil.Process(pid)
    return _processes[pid]


_fits_set_up: set[int] = set()  # pids whose first fit has reached its first step


def startup_seconds(fit_started: float) -> tuple[float | None, float]:
    """``(startup_s, setup_s)`` as a fit's first step is about to run.

    ``setup_s``: this fit's own set-up, from ``fit_started`` (a ``perf_counter`` reading).
    ``startup_s``: seconds since the process started, only for a program's first fit, where that is
    the user's wait; None for a later fit or an interactive session (it would count the session).
    """
    setup_s = time.perf_counter() - fit_started
    pid = os.getpid()
    first = pid not in _fits_set_up
    _fits_set_up.add(pid)
    interactive = hasattr(sys, "ps1") or sys.flags.interactive or "IPython" in sys.modules
    if first and not interactive:
        return seconds_since_process_start(), setup_s
    return None, setup_s


def seconds_since_process_start() -> float:
    """Seconds since this process started: interpreter, imports and set-up included, as ``time``
    would count them.

    On Linux the process's start in clock ticks since boot (``/proc/self/stat``) against
    ``CLOCK_BOOTTIME``: psutil's ``create_time()`` adds a boot time in whole seconds, so its
    difference with ``time.time()`` can be off by up to a second. Elsewhere psutil's figure.
    """
    try:
        with open("/proc/self/stat") as stat:  # field 22, starttime: after "pid (comm)", 20th
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        return max(0.0, since_boot - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, AttributeError, ValueError, IndexError):  # not Linux
        return max(0.0, time.time() - _this_process().create_time())


def rss_bytes() -> int:
    """This process's resident memory, the figure psutil's ``memory_info().rss`` gives.

    On Linux one ``pread`` of ``/proc/<pid>/statm``, kept open (a fork opens its own), quicker
    than psutil's code, cold in the CPU caches at a log step (benchmarks/README.md). psutil
    elsewhere.
    """
    pid = os.getpid()
    fd = _statm.get(pid)
    if fd is None:
        try:
            fd = os.open(f"/proc/{pid}/statm", os.O_RDONLY)
        except OSError:  # not Linux
            fd = -1
        _statm[pid] = fd
    if fd < 0:
        return _this_process().memory_info().rss
    return int(os.pread(fd, 128, 0).split()[1]) * _PAGE  # "size resident shared ..." in pages


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class DeviceMean:
    """Mean of scalar tensors without a host sync per value: one sync when it is read.

    Values are folded into one tensor every ``fold_every`` (rare logging holds no tensor per step);
    floats already read are summed on the host. A value added with a ``keep`` flag (a 0-d bool
    tensor, unread) counts only where it is true: the mean of the finite losses, say.
    """

    def __init__(self, fold_every: int = 256) -> None:
        self.fold_every = fold_every
        self._values: list[torch.Tensor] = []
        self._kept: list[torch.Tensor] = []  # the flags of values added with one
        self.host_sum = 0.0  # of the floats
        self.count = 0  # values that count for certain: floats, and tensors without a flag

    def add(self, value: torch.Tensor | float, keep: torch.Tensor | None = None) -> None:
        if isinstance(value, float):
            self.count += 1
            self.host_sum += value
            return
        if keep is None:
            self.count += 1
        else:  # where, not a product: 0 * NaN is NaN
            value = torch.where(keep, value.float(), 0.0)
            self._kept.append(keep)
        self._values.append(value)
        if len(self._values) >= self.fold_every:
            self._values = [torch.stack(self._values).float().sum()]
        if len(self._kept) >= self.fold_every:
            self._kept = [torch.stack(self._kept).float().sum()]

    @property
    def empty(self) -> bool:
        """Whether nothing was added since the last :meth:`pop`."""
        return not (self.count or self._values)

    def pop(self) -> float:
        """The mean so far (syncs once), then start over; NaN when nothing counted."""
        total, count = self.host_sum, float(self.count)
        sums = []
        if self._values:
            sums.append(torch.stack(self._values).float().sum())
        if self._kept:
            sums.append(torch.stack(self._kept).float().sum())
        if sums:
            read = torch.stack(sums).tolist()  # host sync: the one per log step
            total += read[0]
            count += read[1] if self._kept else 0.0
        self._values, self._kept, self.host_sum, self.count = [], [], 0.0, 0
        return total / count if count else float("nan")


class StepMeter:
    """What happened between two log steps: loss, gradient norm, throughput, data wait, memory.

    Add the seconds spent blocked on the next batch to :attr:`data_wait`, call :meth:`add`
    after each optimizer step (no host sync) and :meth:`read` at log steps. With
    ``tokens_per_sample`` (a language model's sequence length) it reports tokens/s too; a step
    that says its real tokens (``add(tokens=)``, a device count) reports those per second.

    Example:
        >>> meter = StepMeter(torch.device("cpu"))
        >>> meter.add(samples=64, loss=loss)  # doctest: +SKIP
        >>> meter.read()["throughput/samples_per_s"]  # doctest: +SKIP
    """

    def __init__(self, device: torch.device, tokens_per_sample: int | None = None,
                 flops: FlopsMeter | None = None) -> None:
        self.device = device
        self.tokens_per_sample = tokens_per_sample
        # a FlopsMeter (trainkit.observe.flops): TFLOP/s and MFU in every window; None: none
        self.flops = flops
        self.loss = DeviceMean()
        self.grad_norm = DeviceMean()
        # a forward's own scalars by name (trainkit.loop.step.add_scalars), logged as train/<name>
        self.own: dict[str, DeviceMean] = {}
        self.cuda_peak_gib = 0.0  # largest window peak so far (each window resets torch's)
        self.restart()

    def restart(self) -> None:
        """Start a new window now."""
        self._start = time.perf_counter()
        self.steps = 0
        self.samples = 0
        self.tokens: torch.Tensor | None = None  # real tokens, summed on the device
        self.data_wait = 0.0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def add(self, samples: int, loss: torch.Tensor | float | None = None,
            grad_norm: torch.Tensor | None = None, keep: torch.Tensor | None = None,
            tokens: torch.Tensor | None = None) -> None:
        """One step; ``keep`` (a device flag) leaves out the loss and norm where it is false;
        ``tokens``: the step's real tokens (a device count, read at :meth:`read` only)."""
        self.steps += 1
        self.samples += samples
        if tokens is not None:
            self.tokens = tokens if self.tokens is None else self.tokens + tokens
        if type(loss) is float:  # read on the host already (every CPU step): summed right here
            self.loss.host_sum += loss
            self.loss.count += 1
        elif loss is not None:
            self.loss.add(loss, keep)
        if grad_norm is not None:
            self.grad_norm.add(grad_norm, keep)

    def read(self) -> dict[str, float]:
        """The window's figures as TensorBoard tags; then a new window starts."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the clock must see the queued work finish
        elapsed = time.perf_counter() - self._start
        if self.flops is not None:  # the one-off FLOP count is no training time
            elapsed -= self.flops.pop_count_seconds()
        elapsed = max(elapsed, 1e-9)
        tokens = (self.tokens.item() if self.tokens is not None  # host read: a log step's
                  else self.samples * self.tokens_per_sample if self.tokens_per_sample else None)
        scalars = {
            "train/loss": self.loss.pop(),
            "throughput/samples_per_s": self.samples / elapsed,
            "throughput/steps_per_s": self.steps / elapsed,
            **({"throughput/tokens_per_s": tokens / elapsed} if tokens is not None else {}),
            "time/step_ms": 1000 * elapsed / max(self.steps, 1),
            "time/data_wait_pct": 100 * self.data_wait / elapsed,
            "memory/cpu_rss_gib": rss_bytes() / GIB,
        }
        if self.flops is not None:
            scalars.update(self.flops.window(self.samples, elapsed))
        grad_norm = self.grad_norm.pop()
        if grad_norm == grad_norm:  # not NaN: norms were computed (clipping by norm is on)
            scalars["optim/grad_norm"] = grad_norm
        scalars.update({f"train/{name}": mean.pop() for name, mean in self.own.items()
                        if not mean.empty})  # one host read each, at log steps only
        scalars.update({f"memory/{k}": v for k, v in memory_stats(self.device).items()})
        self.cuda_peak_gib = max(self.cuda_peak_gib,
                                 scalars.get("memory/cuda_peak_allocated_gib", 0.0))
        self.restart()
        return scalars

    def peaks(self) -> dict[str, float]:
        """Peak memory of the whole run so far, for summary.json."""
        peaks = self.peaks_of(self.device)
        if "cuda_peak_allocated_gib" in peaks:
            peaks["cuda_peak_allocated_gib"] = max(self.cuda_peak_gib,
                                                   peaks["cuda_peak_allocated_gib"])
        return peaks

    @staticmethod
    def peaks_of(device: torch.device) -> dict[str, float]:
        """This process's peak RSS and, on CUDA, torch's peak allocation since its last reset."""
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peaks = {"cpu_peak_rss_gib": kib * (1 if sys.platform == "darwin" else 1024) / GIB}
        if device.type == "cuda":
            peaks["cuda_peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        return peaks
