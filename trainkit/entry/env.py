"""``python -m trainkit.env``: what torch sees on this machine, then a matmul to prove it works.

The report users otherwise assemble from blog posts before every job: versions, CUDA and its
devices, MPS, CPU threads, the distributed environment variables, and a sanity check.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Any

import torch

from trainkit.core.device import GIB, available_devices, bf16_native, resolve_device
from trainkit.core.errors import TrainkitError, command_name, help_text, print_error

# What torchrun sets for each worker, what SLURM sets for each task, and the knobs that change how
# the backends connect (the usual suspects when a multi-node job hangs at start-up).
DIST_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
    "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS",
    "SLURM_JOB_NUM_NODES", "SLURM_JOB_NODELIST", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME",
    "NCCL_IB_DISABLE", "GLOO_SOCKET_IFNAME", "TORCH_DISTRIBUTED_DEBUG", "TRAINKIT_DIST_TIMEOUT_S",
)


def collect() -> dict[str, Any]:
    """The report as a dict (also usable from scripts)."""
    import torchvision

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "cuda_build": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": _nccl_version(),
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": [],
        "driver": _driver_version(),
        "mps_available": bool(getattr(torch.backends, "mps", None)
                              and torch.backends.mps.is_available()),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "distributed_env": {k: os.environ[k] for k in DIST_VARS if k in os.environ},
        "available_devices": available_devices(),
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["cuda_devices"].append({
                "index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                "memory_gib": round(p.total_memory / GIB, 1),
                "bf16": bf16_native((p.major, p.minor), hip=bool(torch.version.hip)),
            })
    return info


def sanity_check(device: torch.device, n: int = 1024) -> dict[str, Any]:
    """Multiply two n x n matrices on ``device`` and compare with the CPU result."""
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    expected = a @ b
    start = time.perf_counter()
    got = (a.to(device) @ b.to(device)).cpu()  # .cpu() waits for the device to finish
    seconds = time.perf_counter() - start
    error = (got - expected).abs().max().item() / expected.abs().max().item()
    return {"device": str(device), "seconds": seconds, "max_rel_error": error,
            "ok": error < 1e-2}  # TF32 on Ampere+ GPUs is ~1e-3 relative


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=command_name("trainkit.env"),
                                     description=help_text(__doc__))
    parser.add_argument("--device", default="auto", help="device for the sanity check")
    args = parser.parse_args(argv)
    info = collect()
    rows = [
        ("python", info["python"]), ("platform", info["platform"]),
        ("torch", info["torch"]), ("torchvision", info["torchvision"]),
        ("CUDA (torch build)", info["cuda_build"] or "none (CPU-only build)"),
        ("cuDNN", info["cudnn"]), ("NCCL", info["nccl"]),
        ("NVIDIA driver", info["driver"]),
        ("CUDA available", info["cuda_available"]),
        ("CUDA devices", len(info["cuda_devices"])),
    ]
    for d in info["cuda_devices"]:
        rows.append((f"  cuda:{d['index']}", f"{d['name']}, compute capability {d['capability']}, "
                     f"{d['memory_gib']} GiB, bf16 "
                     f"{'yes' if d['bf16'] else 'no (emulated only: use 16-mixed)'}"))
    rows += [
        ("MPS available", info["mps_available"]),
        ("CPU cores / torch threads", f"{info['cpu_count']} / {info['torch_threads']}"),
        ("distributed env", " ".join(f"{k}={v}" for k, v in info["distributed_env"].items())
         or "none (single process)"),
        ("devices usable", ", ".join(info["available_devices"])),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value if value is not None else 'n/a'}")
    try:
        device = resolve_device(args.device, int(os.environ.get("LOCAL_RANK", 0)))
    except TrainkitError as err:
        print_error(str(err), err.details)
        return 2
    check = sanity_check(device)
    verdict = "ok" if check["ok"] else "WRONG RESULT"
    print(f"{'sanity check':<{width}}  1024x1024 matmul on {check['device']}: {verdict} "
          f"(max rel. error {check['max_rel_error']:.1e}, {check['seconds'] * 1000:.1f} ms)")
    return 0 if check["ok"] else 1


def _nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # CPU builds have no NCCL
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _driver_version() -> str | None:
    if not torch.cuda.is_available():
        return None
    try:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        lib.cuDriverGetVersion(ctypes.byref(version))
        major, minor = divmod(version.value, 1000)
        return f"{major}.{minor // 10} (CUDA driver API)"
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
