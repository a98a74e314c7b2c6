"""The step meter's memory figure: read cheaply, the same as psutil's, in a forked child too."""

from __future__ import annotations

import json
import mmap
import os

import psutil
import pytest
import torch

from trainkit.observe.metrics import StepMeter, rss_bytes

MIB = 2**20


def touched(size: int) -> mmap.mmap:
    """``size`` bytes of fresh pages, written: resident whatever the heap kept from earlier."""
    block = mmap.mmap(-1, size)
    block.write(b"\x01" * size)
    return block


def test_rss_is_psutils_figure_and_follows_allocations() -> None:
    before = rss_bytes()
    assert abs(before - psutil.Process().memory_info().rss) < 4 * MIB
    block = touched(64 * MIB)
    assert rss_bytes() - before > 48 * MIB
    block.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_reads_its_own_memory_not_its_parents() -> None:
    rss_bytes()  # the parent's file is open before the fork
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: grow, then report both figures (no torch op: OpenMP and fork)
        try:
            start = rss_bytes()
            block = touched(128 * MIB)
            os.write(write, json.dumps([start, rss_bytes(), psutil.Process().memory_info().rss,
                                        len(block)]).encode())
        finally:
            os._exit(0)
    os.close(write)
    start, ours, psutils, _ = json.loads(os.read(read, 1000))
    os.waitpid(pid, 0)
    assert abs(ours - psutils) < 4 * MIB
    assert ours - start > 96 * MIB  # the child's own growth: the parent's file would not show it


def test_the_meter_logs_the_current_rss() -> None:
    meter = StepMeter(torch.device("cpu"))
    meter.add(32, 1.5)
    meter.add(32, 2.5)
    scalars = meter.read()
    assert scalars["train/loss"] == 2.0
    assert abs(scalars["memory/cpu_rss_gib"] * 2**30 - rss_bytes()) < 4 * MIB
