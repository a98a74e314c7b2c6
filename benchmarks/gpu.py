"""GPU benchmarks in one short run, written to one JSON file.

    python -m benchmarks.gpu --out gpu_results.json    # on a CUDA machine: a few minutes
    python -m benchmarks.gpu --quick                   # fewer batches, a one-epoch shaped run
    python -m benchmarks.gpu --quick --device cpu      # the same code on tiny sizes (the tests)

All on generated data in CIFAR-10's own file format (50,000 training images, as the real set):

- ``loader_samples_per_s``: batches reaching the GPU from a plain DataLoader (pinned memory,
  ``non_blocking`` copies, normalised on the device), from the same DataLoader through
  :class:`~trainkit.data.DevicePrefetcher` (copy of the next batch overlapped with this one), and
  from the GPU-resident :class:`~trainkit.data.InMemoryLoader` with flip + translate augmentation.
- ``cifar_train_samples_per_s``: CifarNet training steps (bf16, channels_last) fed by each.
- ``precision``: speed and peak memory of fp32, bf16-mixed and 16-mixed steps through trainkit's
  :class:`~trainkit.loop.precision.Precision` (16-mixed runs the GradScaler path).
- ``shaped_run``: ``python -m trainkit.train +exp=cifar``, the recipe aiming at 94% on the real set,
  end to end on the generated files: whole-process seconds, training seconds and samples/s from
  its ``summary.json``, peak memory. The generated images are an easy task (each class tints one
  band), so its accuracy says nothing of the real set; its time is what the real recipe costs.
  Needs hydra-core (skipped, with the reason, without it).

Ratios are of sides measured in the same run. Without CUDA (and no ``--device cpu``) it reports
why and exits 0, so it can sit in any benchmark run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import emit, row, run_process
from trainkit.core.device import memory_stats

Step = Callable[[torch.Tensor, torch.Tensor], None]
TINY_WIDTHS = (8, 16, 32, 32)  # CifarNet's widths for --quick on the CPU: its code, quickly


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the clock reads finished work only


def _timed(epoch: Callable[[], Iterable], n: int, device: torch.device,
           step: Step | None = None) -> float:
    """Samples/s over ``n`` batches consumed on the device, after two warm-up batches.

    ``epoch()`` gives one pass over the data; it is called again whenever a pass ends.
    """
    def forever() -> Iterator:
        while True:
            yield from epoch()

    stream = forever()
    for _ in range(2):
        x, y = next(stream)
        step(x, y) if step else x.sum()
    _sync(device)
    start, seen = time.perf_counter(), 0
    for _ in range(n):
        x, y = next(stream)
        step(x, y) if step else x.sum()
        seen += len(x)
    _sync(device)
    return seen / (time.perf_counter() - start)


def shaped_run(root: Path, device: torch.device, quick: bool) -> dict[str, Any]:
    """``+exp=cifar`` end to end on the generated files, in its own process, as users run it.

    ``--quick --device cpu`` (the tests) runs two steps of a narrow net: the path, not a figure.
    """
    if importlib.util.find_spec("hydra") is None:
        return {"skipped": "hydra-core is not installed (pip install hydra-core)"}
    overrides = ["+exp=cifar", f"data.root={root}", "data.verify=false", "data.download=false",
                 f"trainer.device={device.type}"]
    if quick:
        overrides += ["trainer.max_epochs=1", "data.batch_size=64", "data.eval_batch_size=256"]
    if device.type == "cpu":
        overrides.append("trainer.precision=32")  # bf16 is emulated, and slow, on most CPUs
    if quick and device.type == "cpu":
        overrides += ["trainer.max_steps=2", f"model.widths=[{','.join(map(str, TINY_WIDTHS))}]"]
    with tempfile.TemporaryDirectory() as run_dir:
        try:
            process_s, _ = run_process([sys.executable, "-m", "trainkit.train", *overrides,
                                        f"hydra.run.dir={run_dir}"])
        except SystemExit as failure:  # the other measurements still run
            return {"failed": str(failure)}
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    return {
        "command": "python -m trainkit.train " + " ".join(overrides),
        "process_s": process_s,
        "train_s": summary["wall_time_s"],  # fit: training and the per-epoch evaluations
        "samples_per_s": summary["samples_per_s"],
        "steps": summary["global_step"],
        "peak_memory": summary["peak_memory"],
        "val_acc_generated_data": summary["metrics"].get("val/acc"),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches, a shorter run")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to try the script")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--out", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        reason = "CUDA is not available on this machine"
        result = {"benchmark": "gpu", "skipped": reason, "rows": [row("gpu", None, reason, None)]}
    else:
        result = _measure(device, args)
    emit(result)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _measure(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    from torch.utils.data import TensorDataset

    from tests.helpers.fakes import write_fake_cifar10
    from trainkit.data import DevicePrefetcher, InMemoryLoader, make_loader
    from trainkit.data.sources.tensors import load_cifar10
    from trainkit.loop.precision import Precision
    from trainkit.models import CifarNet

    tiny = args.quick and device.type == "cpu"
    batch = 16 if tiny else args.batch_size
    n_batches = 2 if tiny else 20 if args.quick else 100
    with tempfile.TemporaryDirectory() as tmp:
        root = write_fake_cifar10(Path(tmp), n_train=512 if tiny else 50_000,
                                  n_test=64 if tiny else 10_000)
        data = load_cifar10(root, train=True, verify=False, download=False)
        shaped = shaped_run(root, device, args.quick)

    mean, std = list(data.mean), list(data.std)
    dataset = TensorDataset(data.images, data.labels)  # uint8 over PCIe: 4x fewer bytes
    loader = make_loader(dataset, batch, shuffle=True, device=device, num_workers=2)
    mean_t = torch.tensor(mean, device=device).view(1, 3, 1, 1)
    std_t = torch.tensor(std, device=device).view(1, 3, 1, 1)

    def plain() -> Iterator:  # the common way: move (pinned, non_blocking), then normalise
        for x, y in loader:
            x = x.to(device, non_blocking=True).float().div_(255)
            yield (x - mean_t) / std_t, y.to(device, non_blocking=True)

    resident = InMemoryLoader(data, batch, shuffle=True, device=device, padding=2, flip=True,
                              pad_mode="reflect", channels_last=True)
    prefetched = DevicePrefetcher(loader, device, mean=mean, std=std, channels_last=True)
    model = (CifarNet(TINY_WIDTHS) if tiny else CifarNet()).to(
        device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)

    def precision_step(mode: str) -> Step:
        precision = Precision(mode, device)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            with precision.autocast():
                loss = F.cross_entropy(model(x), y, label_smoothing=0.2)
            precision.backward(loss)
            precision.step(optimizer)
            optimizer.zero_grad(set_to_none=True)

        return step

    bf16 = precision_step("bf16-mixed")
    epochs = {"dataloader_no_prefetcher": plain, "dataloader_prefetcher": lambda: prefetched,
              "in_memory_gpu_resident": lambda: resident}
    result: dict[str, Any] = {
        "benchmark": "gpu",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "batch_size": batch,
        "batches_timed": n_batches,
        "loader_samples_per_s": {name: _timed(epoch, n_batches, device)
                                 for name, epoch in epochs.items()},
        "cifar_train_samples_per_s": {name: _timed(epoch, n_batches, device, bf16)
                                      for name, epoch in epochs.items()},
    }
    by_precision = {}
    for mode in ("32", "bf16-mixed", "16-mixed"):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        by_precision[mode] = {
            "train_samples_per_s": _timed(lambda: resident, n_batches, device,
                                          precision_step(mode)),
            "peak_allocated_gib": memory_stats(device).get("cuda_peak_allocated_gib"),
        }
    result["precision"] = by_precision
    result["shaped_run"] = shaped
    result["rows"] = _rows(result)
    return result


def _rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    speeds = result["cifar_train_samples_per_s"]
    plain = speeds["dataloader_no_prefetcher"]
    precision = result["precision"]
    fp32 = precision["32"]["train_samples_per_s"]
    rows = [
        row("gpu: prefetcher/plain DataLoader train speed",
            speeds["dataloader_prefetcher"] / plain, "> 1 (overlap)",
            speeds["dataloader_prefetcher"] > plain),
        row("gpu: resident/plain DataLoader train speed",
            speeds["in_memory_gpu_resident"] / plain, "> 1",
            speeds["in_memory_gpu_resident"] > plain),
        *[row(f"gpu: {mode}/fp32 train speed", precision[mode]["train_samples_per_s"] / fp32,
              "> 1 (AMP)", precision[mode]["train_samples_per_s"] > fp32)
          for mode in ("bf16-mixed", "16-mixed")],
    ]
    if precision["32"]["peak_allocated_gib"]:
        rows.append(row("gpu: bf16-mixed/fp32 peak memory",
                        precision["bf16-mixed"]["peak_allocated_gib"]
                        / precision["32"]["peak_allocated_gib"], "< 1", None))
    shaped = result["shaped_run"]
    rows.append(row("gpu: +exp=cifar run on generated data, training seconds",
                    shaped.get("train_s"), "(the 94% recipe; aim <= 3 s on an H200)", None,
                    unit="s"))
    return rows


if __name__ == "__main__":
    main()
