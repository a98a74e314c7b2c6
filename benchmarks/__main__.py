"""`python -m benchmarks [--quick]`: run every benchmark, print a table, write results JSON."""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from benchmarks import gpu_data, loaders, mnist_e2e, overhead

BENCHMARKS = {"mnist_e2e": mnist_e2e.main, "overhead": overhead.main, "loaders": loaders.main,
              "gpu_data": gpu_data.main}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny runs: check they work")
    parser.add_argument("--out", default="benchmarks/results.json")
    args = parser.parse_args()
    results = {name: run(["--quick"] if args.quick else []) for name, run in BENCHMARKS.items()}
    results["_machine"] = {"platform": platform.platform(), "processor": platform.processor(),
                           "date": time.strftime("%Y-%m-%d")}
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"\n{'benchmark':<12} result")
    print(f"{'mnist_e2e':<12} {results['mnist_e2e']['median_process_s']:.1f} s whole process, "
          f"val/acc {results['mnist_e2e']['min_val_acc']:.4f}")
    print(f"{'overhead':<12} trainer/loop steps-per-s ratio {results['overhead']['ratio']:.3f}")
    for name in loaders.AUGMENT:
        r = results["loaders"][name]
        print(f"{'loaders':<12} {name}: in-memory / per-sample torchvision samples-per-s ratio "
              f"{r['ratio']:.1f}")
    gpu = results["gpu_data"]
    print(f"{'gpu_data':<12} " + (gpu["skipped"] if "skipped" in gpu else
          f"CIFAR {gpu['cifar_steps_per_s_bf16_channels_last']:.1f} steps/s bf16+channels_last"))
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
