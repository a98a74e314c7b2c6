"""Models for tests that need a model to misbehave in a specific way."""

from __future__ import annotations

import torch

from trainkit.models import MnistNet


class OutOfMemoryNet(MnistNet):
    """MnistNet whose third training forward raises the error an exhausted GPU raises."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == 3:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().forward(x)


class BuggyNet(MnistNet):
    """MnistNet with a bug in its code: its second training forward divides by zero."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == 2:
                return super().forward(x) / (1 // 0)
        return super().forward(x)


def fill_device(device: torch.device) -> None:
    """Run a CUDA device out of memory for real: 1 GiB blocks until the caching allocator
    refuses one, all held by this frame (so by the error's traceback, until whoever catches
    it lets it go: the release a harness must get right). Elsewhere one request larger than
    any machine, refused before anything is allocated."""
    if device.type != "cuda":
        torch.empty(2**48, dtype=torch.uint8, device=device)  # 256 TiB
        return
    held = []
    while True:
        held.append(torch.empty(2**30, dtype=torch.uint8, device=device))


class ExhaustingNet(MnistNet):
    """MnistNet whose third training forward fills the device's memory until the allocator
    refuses (a real out-of-memory on a GPU, from the caching allocator itself)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == 3:
                fill_device(x.device)
        return super().forward(x)


class BatchHungryNet(MnistNet):
    """MnistNet whose training forward over more than 8 samples fills the device's memory: a
    real CUDA out-of-memory above a micro-batch of 8, with the memory really taken, so
    ``trainer.micro_batch_size=auto`` settles at 8 only if each failed try's memory was
    released (benchmarks/gpu_check.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and len(x) > 8:
            fill_device(x.device)
        return super().forward(x)
