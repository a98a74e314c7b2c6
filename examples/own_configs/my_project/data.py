"""The dataset hook: a function ``(root, train, **your keys) -> TensorData`` for one split.

trainkit's loaders take the whole split as uint8 images ``[N, C, H, W]`` with int64 labels and
normalise batches on the device with ``mean``/``std`` (0..1 units, per channel). Read your files
from ``root`` (``data.root`` in the config) here; this example draws its images instead.
"""

from __future__ import annotations

import torch

from trainkit import TensorData


def make_bars(root: str, train: bool, *, size: int = 16, n_train: int = 1024, n_test: int = 256,
              seed: int = 0) -> TensorData:
    """Noisy images with one bright bar; the class is the bar's orientation and half (4 classes).

    ``root`` is unused: the images are drawn from ``seed``, the test split from another seed.
    """
    n = n_train if train else n_test
    gen = torch.Generator().manual_seed(seed if train else seed + 1)
    labels = torch.randint(0, 4, (n,), generator=gen)
    images = torch.randint(0, 80, (n, 1, size, size), generator=gen, dtype=torch.uint8)
    offsets = torch.randint(0, size // 2 - 1, (n,), generator=gen)
    for i, (label, offset) in enumerate(zip(labels.tolist(), offsets.tolist())):
        line = offset + (size // 2 if label % 2 else 0)  # which half of the image
        if label < 2:
            images[i, 0, line, :] = 255  # a row
        else:
            images[i, 0, :, line] = 255  # a column
    return TensorData(images, labels, mean=(0.2,), std=(0.3,), num_classes=4)
