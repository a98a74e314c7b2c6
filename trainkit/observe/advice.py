"""Say in one line what holds a run back, read from the figures each log window already has.

:class:`Advisor` reads a window's scalars at log steps only, and says each finding once per run
(a ``train.log`` line and an entry of summary.json's ``advice``): **input-bound** (the step
waited for data ``wait_share`` of the time in ``windows`` windows in a row, the first excluded;
the line names the setting to try), **memory** (a window's peak within a few percent of the
device's memory), and on CUDA **host reads** (the forward synchronises with the GPU in
``windows`` sampled steps in a row, one step a window run under
``torch.cuda.set_sync_debug_mode``; on a CPU a host read costs nothing, so the rule is off).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import psutil
import torch

from trainkit.core.device import GIB

PREFIX = "advice: "


class Advisor:
    """Turns log windows into at most one line per finding (see the module's docstring).

    Args:
        device: the run's device.
        data: the training loader, to name the setting that would feed it faster.
        wait_share: data-wait share (0-1) of a window that counts as waiting.
        windows: windows in a row that make a finding (data wait, host reads).
        memory_share: share of the device's memory a window's peak must reach.

    Example:
        >>> advisor = Advisor(torch.device("cpu"), loader)  # doctest: +SKIP
        >>> for line in advisor.window(meter.read(), step): log.warning(line)  # doctest: +SKIP
    """

    def __init__(self, device: torch.device, data: Any = None, *, wait_share: float = 0.3,
                 windows: int = 3, memory_share: float = 0.95) -> None:
        self.device, self.data = device, data
        self.wait_share, self.windows, self.memory_share = wait_share, windows, memory_share
        self.lines: list[str] = []  # what was said, in order (summary.json's `advice`)
        self._said: set[str] = set()
        self._seen = 0
        self._waits: list[float] = []  # the current run of waiting windows' shares
        self._sync_streak = 0
        self._sampled: list[int] = []  # syncs counted in sampled forwards since the last window
        if device.type == "cuda":
            self._total_gib = torch.cuda.get_device_properties(device).total_memory / GIB
            self._where = f"{device}'s"
        else:
            self._total_gib = psutil.virtual_memory().total / GIB
            self._where = "the machine's"

    def window(self, scalars: Mapping[str, float], step: int, train_step: Any = None
               ) -> list[str]:
        """Read one log window's scalars; return the log lines newly said (usually none).

        Each starts with ``advice: ``; :attr:`lines` keeps the same text without it.

        ``train_step`` (a :class:`~trainkit.loop.step.WindowStep`) gets its next forward sampled
        for host reads on CUDA.
        """
        self._seen += 1
        found = [self._input(scalars, step), self._memory(scalars), self._host_reads(step)]
        if train_step is not None and self.device.type == "cuda" and "host" not in self._said:
            self._sample_next_forward(train_step)
        new = [line for line in found if line is not None]
        self.lines += new
        return [PREFIX + line for line in new]

    # -- the findings -------------------------------------------------------------------------

    def _input(self, scalars: Mapping[str, float], step: int) -> str | None:
        share = scalars.get("time/data_wait_pct", 0.0) / 100
        if self._seen == 1 or "input" in self._said:  # the first window holds the start-up
            return None
        self._waits = [*self._waits, share] if share >= self.wait_share else []
        if len(self._waits) < self.windows:
            return None
        mean = sum(self._waits) / len(self._waits)
        return self._say("input", f"input-bound: the step waited for data {mean:.0%} of the "
                                  f"time over {len(self._waits)} log windows (to step {step}); "
                                  f"try {input_hint(self.data)}; `trainkit probe` measures it")

    def _memory(self, scalars: Mapping[str, float]) -> str | None:
        peak = scalars.get("memory/cuda_peak_allocated_gib", scalars.get("memory/cpu_rss_gib"))
        if peak is None or "memory" in self._said or peak < self.memory_share * self._total_gib:
            return None
        what = "peak allocated" if self.device.type == "cuda" else "resident memory"
        return self._say("memory", f"memory: {what} {peak:.2f} GiB is "
                                   f"{peak / self._total_gib:.0%} of {self._where} "
                                   f"{self._total_gib:.1f} GiB: one larger batch or activation "
                                   "can run out; lower data.batch_size, or try "
                                   "trainer.activation_checkpointing or bf16-mixed")

    def _host_reads(self, step: int) -> str | None:
        sampled, self._sampled = self._sampled, []
        if not sampled:
            return None
        self._sync_streak = self._sync_streak + 1 if min(sampled) > 0 else 0
        if self._sync_streak < self.windows or "host" in self._said:
            return None
        return self._say("host", f"host reads: the forward pass synchronised with the GPU "
                                 f"{max(sampled)} time(s) in each of {self._sync_streak} sampled "
                                 f"steps (to step {step}): the GPU idles while the host waits; "
                                 "keep values as tensors (.item(), .cpu(), `if tensor:` read "
                                 "it) and read them at log steps")

    def _say(self, kind: str, text: str) -> str:
        self._said.add(kind)
        return text

    # -- host reads: one sampled forward a window ---------------------------------------------

    def _sample_next_forward(self, train_step: Any) -> None:
        """Count the synchronising CUDA calls of ``train_step``'s next forward, once (on every
        path of the step: fp32, autocast, accumulation; :meth:`WindowStep.wrap_forward_once`)."""

        def counting(forward: Any) -> Any:
            def counted(model: torch.nn.Module, batch: Any) -> Any:
                previous = torch.cuda.get_sync_debug_mode()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        result = forward(model, batch)
                    finally:
                        torch.cuda.set_sync_debug_mode(previous)
                self._sampled.append(sum("synchroniz" in str(w.message) for w in caught))
                return result

            return counted

        train_step.wrap_forward_once(counting)


def input_hint(data: Any) -> str:
    """The setting most likely to feed ``data`` faster, in the entry point's words."""
    from trainkit.data.loader.memory import InMemoryLoader

    if isinstance(data, InMemoryLoader):
        return ("a larger data.batch_size (the in-memory loader's gather and augmentation run "
                "once a batch)")
    inner = data
    while inner is not None and not hasattr(inner, "num_workers") and hasattr(inner, "loader"):
        inner = inner.loader  # DevicePrefetcher -> ResumableLoader -> DataLoader
    workers = getattr(inner, "num_workers", None)
    if workers is None:
        return "more loader workers (num_workers) and pinned memory, or the samples kept in memory"
    return (f"data.num_workers={max(2, 2 * workers)} (now {workers}), or data.loader=memory "
            "for tensor data (MNIST, CIFAR-10, a reader's TensorData)")
