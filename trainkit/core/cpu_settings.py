"""Process-wide CPU settings for a run: glibc's allocator keeps freed memory for reuse.

glibc unmaps a freed block over its mmap threshold and trims the heap's free top, so a step that
frees and reallocates the same activation buffers page-faults them in again every step (the
cost is in benchmarks/README.md). Raising both thresholds keeps the freed memory for the next
step; the process then keeps its peak heap instead of giving it back.
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
