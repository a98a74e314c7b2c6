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


class ExhaustingNet(MnistNet):
    """MnistNet whose third training forward asks the allocator for more than any device has
    (a real out-of-memory on a GPU, from the caching allocator itself)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == 3:
                x = x + torch.empty(2**48, dtype=torch.uint8, device=x.device).sum()  # 256 TiB
        return super().forward(x)


class BatchHungryNet(MnistNet):
    """MnistNet whose training forward over more than 8 samples asks the allocator for more
    than any device has: a real CUDA out-of-memory above a micro-batch of 8
    (``trainer.micro_batch_size=auto`` must settle at 8; benchmarks/gpu_check.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and len(x) > 8:
            x = x + torch.empty(2**48, dtype=torch.uint8, device=x.device).sum()  # 256 TiB
        return super().forward(x)
