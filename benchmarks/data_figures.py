"""The data pipeline's small figures, each the reason for a choice its code's comment names.

    python -m benchmarks.data_figures

Each line: what is compared, the median of several timed repeats of each side, and the ratio.
One process, sides timed alternately; on a shared machine the absolute times are noisy, the
ratios less so.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import torch


def _median(fn: Callable[[], object], repeats: int = 7, number: int = 20) -> float:
    """Seconds per call of ``fn``: the median over ``repeats`` timings of ``number`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - start) / number)
    return statistics.median(times)


def _import_seconds(module: str) -> float:
    """Seconds a fresh interpreter takes to import ``module`` (less a bare interpreter's)."""
    def run(code: str) -> float:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        return time.perf_counter() - start
    return statistics.median(run(f"import {module}") - run("pass") for _ in range(3))


def figures() -> list[str]:
    """One line per figure."""
    from trainkit.data.loader.augment import _by_gather, _by_unfold
    from trainkit.data.transforms import Normalize

    torch.set_num_threads(1)
    lines = []
    images = torch.randint(0, 256, (50_000, 3, 32, 32), dtype=torch.uint8)
    index = torch.randint(0, 50_000, (256,))
    fancy = _median(lambda: images[index])
    select = _median(lambda: images.index_select(0, index))
    lines.append(f"batch gather (loader/memory.py): images[index] {fancy * 1e6:.0f} us, "
                 f"index_select {select * 1e6:.0f} us: {fancy / select:.1f}x")
    batch = images[:256]
    norm = Normalize((0.5, 0.4, 0.3), (0.2, 0.25, 0.3), "cpu")
    mixed = _median(lambda: torch.addcmul(norm.shift, batch, norm.scale))
    cast = _median(lambda: norm(batch))
    lines.append(f"normalise on CPU (transforms.py Normalize): mixed-dtype addcmul "
                 f"{mixed * 1e6:.0f} us, cast then addcmul {cast * 1e6:.0f} us: "
                 f"{mixed / cast:.1f}x")
    shifts = torch.randint(-4, 5, (2, 256))
    flips = torch.rand(256) < 0.5
    gather = _median(lambda: _by_gather(batch, shifts, flips, 4, "constant"), number=5)
    unfold = _median(lambda: _by_unfold(batch, shifts, flips, 4, "constant"), number=5)
    lines.append(f"crop+flip of 256 32x32 images (loader/augment.py): gather "
                 f"{gather / 256 * 1e6:.1f} us an image, unfold {unfold / 256 * 1e6:.1f} us: "
                 f"{gather / unfold:.1f}x")
    seed = _median(lambda: (random.seed(1), np.random.seed(1),
                            torch.default_generator.manual_seed(1)), number=200)
    full = _median(lambda: torch.manual_seed(1), number=200)
    lines.append(f"seeding a worker (loader/resumable.py SeededSamples): python+numpy+torch CPU "
                 f"{seed * 1e6:.1f} us; torch.manual_seed {full * 1e6:.1f} us "
                 f"(CUDA {'initialised' if torch.cuda.is_initialized() else 'not initialised'})")
    lines += [_decode_line(), _md5_line()]
    for module, where in (("torchvision.transforms.v2.functional", "sources/webdataset.py"),
                          ("torchvision.datasets", "tools/download.py")):
        lines.append(f"import {module} ({where}): {_import_seconds(module):.2f} s")
    return lines


def _decode_line() -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (28, 28), np.uint8)).save(
        buffer, format="PNG")
    data = buffer.getvalue()
    one = _median(lambda: np.asarray(Image.open(io.BytesIO(data)).convert("L")), number=200)
    return (f"PIL decode of one 28x28 PNG (sources/tensors.py: why a set is held as one "
            f"tensor): {one * 1e6:.0f} us a sample")


def _md5_line() -> str:
    data = os.urandom(55 * 2**20)
    seconds = _median(lambda: hashlib.md5(data).digest(), repeats=3, number=1)
    return f"md5 of 55 MB (MNIST's files; tools/checksums.py): {seconds:.2f} s"


if __name__ == "__main__":
    from benchmarks import data_structure

    for line in data_structure.figures() + figures():  # the floor plan first, then the timings
        print(line)
