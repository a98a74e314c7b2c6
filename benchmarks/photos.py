"""A folder of photo-like JPEGs for the image benchmarks, generated once and cached.

Each file is cut from one of the photographs scikit-image ships (``skimage.data``: real camera
pictures, so the JPEG decoder meets real image statistics, unlike noise, which decodes at
another speed), scaled to 350-500 px on the short side, colour-jittered, flipped at random, and
saved at JPEG quality 88-92. Generated with all cores in a few seconds; kept in
``$TRAINKIT_BENCH_CACHE`` (default: the temporary folder) under a name that says its size and
version, and reused while complete.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

VERSION = 1
# skimage.data's colour photographs that ship inside the package (no download)
SOURCES = ("astronaut", "chelsea", "coffee", "rocket", "immunohistochemistry", "hubble_deep_field",
           "retina")


def _photos() -> list[np.ndarray]:
    try:
        from skimage import data
    except ImportError:
        raise SystemExit("the image benchmark needs scikit-image: pip install -e '.[bench]'"
                         ) from None
    photos = []
    for name in SOURCES:
        try:
            image = getattr(data, name)()
        except Exception:  # not shipped in this version, or needs a download
            continue
        if image.ndim == 3 and image.shape[2] >= 3 and min(image.shape[:2]) >= 256:
            image = Image.fromarray(np.ascontiguousarray(image[..., :3]))
            image.thumbnail((1000, 1000))  # cutting from larger pictures only costs time
            photos.append(np.asarray(image))
    if not photos:
        raise SystemExit("scikit-image ships none of its sample photographs here")
    return photos


def _make(args: tuple[Path, int, int, int]) -> None:
    root, start, stop, classes = args
    photos = _photos()
    rng = np.random.default_rng(start)
    for i in range(start, stop):
        photo = photos[i % len(photos)]
        h, w = photo.shape[:2]
        ch, cw = (int(s * rng.uniform(0.5, 1.0)) for s in (h, w))  # cut
        top, left = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
        image = Image.fromarray(photo[top:top + ch, left:left + cw])
        short = rng.integers(350, 501)  # scale: 350-500 px on the short side
        scale = short / min(ch, cw)
        image = image.resize((round(cw * scale), round(ch * scale)), Image.BICUBIC)
        pixels = np.asarray(image, dtype=np.float32)
        pixels = pixels * rng.uniform(0.8, 1.2, 3) + rng.uniform(-20, 20)  # colour jitter
        image = Image.fromarray(pixels.clip(0, 255).astype(np.uint8))
        if rng.random() < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        folder = root / f"class_{i % classes:02d}"
        image.save(folder / f"{i:05d}.jpg", quality=int(rng.integers(88, 93)))


def photo_folder(count: int = 3000, classes: int = 10) -> Path:
    """The folder (``<class>/<n>.jpg``, ``count`` files), generated on first use."""
    cache = Path(os.environ.get("TRAINKIT_BENCH_CACHE", tempfile.gettempdir()))
    root = cache / f"trainkit-photos-v{VERSION}-{count}x{classes}"
    done = root / ".complete"
    if done.exists():
        return root
    for c in range(classes):
        (root / f"class_{c:02d}").mkdir(parents=True, exist_ok=True)
    workers = max(1, len(os.sched_getaffinity(0)))
    bounds = np.linspace(0, count, workers * 4 + 1).astype(int)
    jobs = [(root, int(a), int(b), classes) for a, b in itertools.pairwise(bounds) if b > a]
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(_make, jobs))
    done.touch()
    return root
