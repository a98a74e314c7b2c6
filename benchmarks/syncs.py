"""Host syncs in the training loop: they must grow with logging steps, not with steps.

    python -m benchmarks.syncs --out syncs.json   # on a GPU: read counts, sync_debug_mode counts
    python -m benchmarks.syncs --device cpu       # the same code on the CPU (read counts only)

Reading a device tensor on the host (``item``, ``tolist``, ``bool(t)``, ``float(t)``, ``.cpu()``,
...) makes the CPU wait for the GPU, so it cannot queue the next step meanwhile. ``Trainer.fit``
reads only at logging steps (and checkpoint steps, and the last step), so a run of ``N`` steps
logging every ``L`` makes as many reads as one of ``2N`` steps logging every ``2L``. Measured
three ways, each a check that fails (exit status 1) when a read creeps into every step:

- ``host_reads``: Python-level reads counted by patching those ``torch.Tensor`` methods (any
  device; reads inside C++ are not seen).
- ``sync_warnings`` (CUDA): what ``torch.cuda.set_sync_debug_mode("warn")`` reports, which also
  sees C++ syncs (a blocking copy, ``nonzero``, ...).
- ``strict_window`` (CUDA): steps between two logging steps run under
  ``set_sync_debug_mode("error")``: one sync there fails the run.

``16-mixed`` is reported, not checked: GradScaler reads its overflow flag once per step, by design.
The optimizer is SGD: Adam's step counters are CPU tensors that it reads on the host every step
(no device sync, but the patched count would see it).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.common import emit, row

HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")
CHECKED = ("32", "bf16-mixed")  # no read per step; 16-mixed has GradScaler's one


@contextlib.contextmanager
def counting_host_reads() -> Iterator[Counter[str]]:
    """Count calls of the ``torch.Tensor`` methods that read a tensor on the host, by name."""
    counts: Counter[str] = Counter()
    own = {name: torch.Tensor.__dict__.get(name) for name in HOST_READS}

    def counted(name: str, method: Any) -> Any:
        @functools.wraps(method)
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return method(self, *args, **kwargs)
        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    try:
        yield counts
    finally:
        for name, method in own.items():  # as it was: defined on Tensor, or inherited
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 10))


def _batches(n: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 3, 8, 8, generator=g).to(device),
             torch.randint(0, 10, (16,), generator=g).to(device)) for _ in range(n)]


@contextlib.contextmanager
def gpu_path_on_the_cpu() -> Iterator[None]:
    """The NaN/inf check as on a GPU (read only where the loop waits anyway), on the CPU too,
    where trainkit otherwise reads every step because reading costs nothing there."""
    from trainkit.loop import nonfinite

    free, nonfinite.HOST_READS_FREE = nonfinite.HOST_READS_FREE, frozenset()
    try:
        yield
    finally:
        nonfinite.HOST_READS_FREE = free


def with_own_scalar(model: nn.Module, batch: Any) -> tuple[Any, ...]:
    """The default forward plus a scalar of its own (logged as train/aux, kept on the device)."""
    inputs, targets = batch
    outputs = model(inputs)
    return outputs, targets, {"aux": outputs.detach().pow(2).mean()}


def fit_reads(steps: int, log_every: int, device: torch.device | str, precision: str = "32",
              forward: Any = None) -> dict[str, Any]:
    """One ``Trainer.fit`` of ``steps`` steps (clipping, momentum, the NaN/inf check on, a
    forward with a scalar of its own) with its host reads counted; on CUDA also the syncs
    ``set_sync_debug_mode("warn")`` reports. On the CPU it runs the GPU's path
    (:func:`gpu_path_on_the_cpu`), which is what it is there to check."""
    from trainkit import Trainer, TrainerConfig

    device = torch.device(device)
    model = _model()
    data = _batches(steps, device)
    config = TrainerConfig(device=str(device), max_epochs=1, max_steps=steps,
                           log_every_n_steps=log_every, log_every_n_seconds=0,
                           gradient_clip_val=1.0, precision=precision)
    trainer = Trainer(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    cuda = device.type == "cuda"
    with counting_host_reads() as reads, warnings.catch_warnings(record=True) as caught, \
            (contextlib.nullcontext() if cuda else gpu_path_on_the_cpu()):
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            summary = trainer.fit(model, optimizer, data, forward=forward or with_own_scalar)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    return {"steps": steps, "log_every": log_every, "precision": precision,
            "host_reads": sum(reads.values()), "by_method": dict(reads),
            "sync_warnings": len(syncs) if cuda else None,
            "first_sync": str(syncs[0].message)[:200] if syncs else None,
            "global_step": summary["global_step"]}


def strict_window(device: torch.device, precision: str = "32") -> dict[str, Any]:
    """Steps 12-18 of a run logging every 10 under ``set_sync_debug_mode("error")`` (CUDA)."""
    calls = 0

    def forward(model: nn.Module, batch: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls in (12, 19):  # from the start of step 12 to the start of step 19
            torch.cuda.set_sync_debug_mode("error" if calls == 12 else "default")
        return with_own_scalar(model, batch)

    try:
        fit_reads(30, 10, device, precision, forward=forward)
    except RuntimeError as err:  # the sync that was refused
        return {"ok": False, "error": " ".join(str(err).split())[:300]}
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"ok": True}


def measure(device: torch.device, steps: int = 40, log_every: int = 10) -> dict[str, Any]:
    """For each precision: runs of (N, L), (2N, 2L) -- as many logs -- and (2N, L)."""
    result: dict[str, Any] = {"benchmark": "syncs", "device": str(device), "by_precision": {}}
    failures = []
    for precision in ("32", "bf16-mixed", "16-mixed"):
        runs = [fit_reads(n, every, device, precision)
                for n, every in ((steps, log_every), (2 * steps, 2 * log_every),
                                 (2 * steps, log_every))]
        entry: dict[str, Any] = {"runs": runs}
        if precision in CHECKED:
            for key in ("host_reads", "sync_warnings"):
                same_logs, more_logs = runs[0][key], runs[1][key]
                if same_logs is not None and same_logs != more_logs:
                    failures.append(f"{precision}: {key} grow with steps ({same_logs} over "
                                    f"{steps} steps, {more_logs} over {2 * steps}, same logs)")
            if device.type == "cuda":
                entry["strict_window"] = strict_window(device, precision)
                if not entry["strict_window"]["ok"]:
                    failures.append(f"{precision}: a sync between logging steps: "
                                    f"{entry['strict_window']['error']}")
        result["by_precision"][precision] = entry
    result["failures"] = failures
    result["rows"] = [
        row(f"syncs: {precision} host reads over {2 * steps} vs {steps} steps (same logs)",
            result["by_precision"][precision]["runs"][1]["host_reads"]
            - result["by_precision"][precision]["runs"][0]["host_reads"],
            "0" if precision in CHECKED else "(GradScaler: one a step)",
            None if precision not in CHECKED else not any(f.startswith(precision + ":")
                                                         for f in failures), unit="reads")
        for precision in result["by_precision"]
    ]
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to try the script")
    parser.add_argument("--out", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        reason = "CUDA is not available on this machine"
        result = {"benchmark": "syncs", "skipped": reason, "failures": [],
                  "rows": [row("syncs", None, reason, None)]}
    else:
        result = measure(device)
    emit(result)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if result["failures"]:
        print("\n".join(f"FAIL: {f}" for f in result["failures"]), file=sys.stderr)
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
