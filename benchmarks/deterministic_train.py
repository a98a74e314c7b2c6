"""``python -m benchmarks.deterministic_train <overrides>``: the entry point, deterministic kernels.

The same as ``python -m trainkit.train`` (signals, exit statuses, run directory), inside
:func:`trainkit.core.cuda_settings.deterministic_algorithms`: cuDNN deterministic with autotuning
off, ``torch.use_deterministic_algorithms`` and cuBLAS's fixed workspace. The GPU check runs
through it where it compares two runs bit for bit (a resumed run with an uninterrupted one).
"""

from __future__ import annotations

import contextlib

try:
    from trainkit.core.cuda_settings import deterministic_algorithms
except ImportError:  # trainkit before the CUDA-settings module: the kernels as they come
    deterministic_algorithms = contextlib.nullcontext  # type: ignore[assignment]

from trainkit.entry.train import main

if __name__ == "__main__":
    with deterministic_algorithms():
        main()
