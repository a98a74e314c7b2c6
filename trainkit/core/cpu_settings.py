"""Process-wide CPU settings for a run: glibc's allocator keeps freed memory for reuse.

glibc serves an allocation over its mmap threshold (128 KiB at start, raised only by frees of
larger blocks) with a fresh ``mmap`` and unmaps it on ``free``; it also trims the top of the heap
once 128 KiB there are free. A training step allocates and frees the same activation and
gradient buffers every step, so each step page-faults them in again: ~1,800 faults and ~5 ms
of kernel time per step of the MNIST example on this project's 2-core machine, a quarter of the
step. Raising both thresholds keeps the freed memory in the heap, where the next step finds it
(0 faults). The cost is that the process keeps its peak heap instead of giving it back.
"""

from __future__ import annotations

import ctypes
import platform
import sys

# mallopt(3) parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# Tried in turn: glibc refuses a threshold over half its maximum heap size (32 MiB on 64-bit
# builds that enforce it); an allocation over the threshold still gets its own mapping.
_THRESHOLDS = (1 << 30, 32 << 20)
_kept = False


def keep_freed_memory() -> str:
    """Raise glibc's mmap and trim thresholds for this process; return what was set, as log text.

    Returns ``""`` where the C library is not glibc (macOS, musl, Windows): nothing is changed.
    Setting it twice changes nothing more.

    Example:
        >>> keep_freed_memory() in ("", "freed memory kept for reuse")
        True
    """
    global _kept
    if _kept:
        return "freed memory kept for reuse"
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return ""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return ""
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    for threshold in _THRESHOLDS:
        if mallopt(_M_MMAP_THRESHOLD, threshold):
            mallopt(_M_TRIM_THRESHOLD, threshold)
            _kept = True
            return "freed memory kept for reuse"
    return ""
