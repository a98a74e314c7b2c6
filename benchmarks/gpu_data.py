"""GPU data-path throughput: DataLoader with and without the prefetcher, GPU-resident loader,
CIFAR-10 training steps/s with bf16 and channels_last, and each precision's speed and peak memory
(through trainkit's Precision, so fp16 runs its GradScaler path).

    python -m benchmarks.gpu_data            # on a CUDA machine (generated CIFAR-format data)
    python -m benchmarks.gpu_data --quick    # fewer batches

On a machine without CUDA it prints why and exits 0, so it can sit in any benchmark run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import row

REPO = Path(__file__).resolve().parent.parent


def _timed(batches: Iterable, n: int, step=None) -> float:
    """Samples/s over ``n`` batches consumed on the GPU, after two warm-up batches."""
    def forever() -> Iterable:
        while True:
            yield from batches

    stream = iter(forever())
    for _ in range(2):
        x, y = next(stream)
        step(x, y) if step else x.sum()
    torch.cuda.synchronize()  # the clock reads finished work only
    start, seen = time.perf_counter(), 0
    for _ in range(n):
        x, y = next(stream)
        step(x, y) if step else x.sum()
        seen += len(x)
    torch.cuda.synchronize()
    return seen / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch-size", type=int, default=512)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        result = {"benchmark": "gpu_data", "skipped": "CUDA is not available on this machine"}
        print(json.dumps(result, indent=2))
        return result
    sys.path.insert(0, str(REPO))
    from torch.utils.data import TensorDataset

    from tests.fakes import write_fake_cifar10
    from trainkit.data import DevicePrefetcher, InMemoryLoader, make_loader
    from trainkit.datasets import load_cifar10
    from trainkit.models import CifarNet
    from trainkit.precision import Precision

    device = torch.device("cuda")
    n_batches = 20 if args.quick else 100
    with tempfile.TemporaryDirectory() as tmp:
        root = write_fake_cifar10(Path(tmp), n_train=10_000 if args.quick else 50_000, n_test=64)
        data = load_cifar10(root, train=True, verify=False, download=False)
    mean, std = list(data.mean), list(data.std)
    dataset = TensorDataset(data.images, data.labels)  # uint8 over PCIe: 4x fewer bytes
    loader = make_loader(dataset, args.batch_size, shuffle=True, device=device, num_workers=2)

    def plain() -> Iterable:  # the common way: move (pinned, non_blocking), then normalise
        for x, y in loader:
            x = x.to(device, non_blocking=True).float().div_(255)
            yield (x - torch.tensor(mean, device=device).view(1, 3, 1, 1)) / \
                torch.tensor(std, device=device).view(1, 3, 1, 1), y.to(device, non_blocking=True)

    resident = InMemoryLoader(data, args.batch_size, shuffle=True, device=device, padding=2,
                              flip=True, pad_mode="reflect", channels_last=True)
    prefetched = DevicePrefetcher(loader, device, mean=mean, std=std, channels_last=True)
    model = CifarNet().to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y, label_smoothing=0.2)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    result = {
        "benchmark": "gpu_data",
        "device": torch.cuda.get_device_name(device),
        "batch_size": args.batch_size,
        "loader_samples_per_s": {
            "dataloader_no_prefetcher": _timed(plain(), n_batches),
            "dataloader_prefetcher": _timed(prefetched, n_batches),
            "in_memory_gpu_resident_augmented": _timed(resident, n_batches),
        },
        "cifar_train_samples_per_s": {
            "dataloader_no_prefetcher": _timed(plain(), n_batches, train_step),
            "dataloader_prefetcher": _timed(prefetched, n_batches, train_step),
            "in_memory_gpu_resident": _timed(resident, n_batches, train_step),
        },
    }
    def precision_step(mode: str):
        precision = Precision(mode, device)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            with precision.autocast():
                loss = F.cross_entropy(model(x), y, label_smoothing=0.2)
            precision.backward(loss)
            precision.step(optimizer)
            optimizer.zero_grad(set_to_none=True)

        return step

    by_precision = {}
    for mode in ("32", "bf16-mixed", "16-mixed"):
        torch.cuda.reset_peak_memory_stats(device)
        by_precision[mode] = {
            "train_samples_per_s": _timed(resident, n_batches, precision_step(mode)),
            "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        }
    result["precision"] = by_precision
    fp32 = by_precision["32"]["train_samples_per_s"]
    speeds = result["cifar_train_samples_per_s"]
    result["cifar_steps_per_s_bf16_channels_last"] = (
        speeds["in_memory_gpu_resident"] / args.batch_size)
    gain = speeds["dataloader_prefetcher"] / speeds["dataloader_no_prefetcher"]
    result["rows"] = [
        row("gpu: prefetcher/plain DataLoader", gain, "> 1 (overlap)", gain > 1),
        row("gpu: resident/plain DataLoader",
            speeds["in_memory_gpu_resident"] / speeds["dataloader_no_prefetcher"], "> 1",
            speeds["in_memory_gpu_resident"] > speeds["dataloader_no_prefetcher"]),
        *[row(f"gpu: {mode}/fp32 train speed", by_precision[mode]["train_samples_per_s"] / fp32,
              "> 1 (AMP)", by_precision[mode]["train_samples_per_s"] > fp32)
          for mode in ("bf16-mixed", "16-mixed")],
    ]
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
