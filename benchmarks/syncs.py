"""Host syncs in the training loop: they must grow with logging steps, not with steps.

    python -m benchmarks.syncs --out syncs.json   # on a GPU: read counts, sync_debug_mode counts
    python -m benchmarks.syncs --device cpu       # the same code on the CPU (read counts only)

Three feeds: pre-placed batches (``fit_reads``), the real image loader (``loader_syncs``: uint8
batches from an image folder through ``make_loader``, its collate, pinned memory and the
``DevicePrefetcher``; with ``data.decode=gpu`` also the ``JpegDecoder``), and padded text in a
counted window (``text_syncs``: a forward that declares ``count_targets``, 2 batches a step: the
window's valid targets counted on the device, its real tokens for ``throughput/tokens_per_s``).

Reading a device tensor on the host (``item``, ``tolist``, ``bool(t)``, ``float(t)``, ``.cpu()``,
...) makes the CPU wait for the GPU, so it cannot queue the next step meanwhile. ``Trainer.fit``
reads only at logging steps (and checkpoint steps, and the last step), so a run of ``N`` steps
logging every ``L`` makes as many reads as one of ``2N`` steps logging every ``2L``. Measured
three ways, each a check that fails (exit status 1) when a read creeps into every step:

- ``host_reads``: Python-level reads counted by patching those ``torch.Tensor`` methods (any
  device; reads inside C++ are not seen).
- ``host_syncs``: Python-level calls that make the host wait for a device, counted by patching
  them on any device: ``torch.tensor``/``torch.as_tensor`` of host data onto the run's device (on
  CUDA a blocking copy from pageable memory; on the CPU the same code, counted as it would be),
  ``torch.cuda.synchronize`` and ``Stream``/``Event.synchronize``, and on CUDA ``.to``/``.cuda``
  of an unpinned CPU tensor. With ``data.decode=gpu`` on CUDA, nvJPEG's own waits on its own
  stream (inside ``decode_jpeg``, which returns decoded images) are not counted.
- ``sync_warnings`` (CUDA): what ``torch.cuda.set_sync_debug_mode("warn")`` reports, which also
  sees C++ syncs (a blocking copy, ``nonzero``, ...).
- ``strict_window`` (CUDA): steps between two logging steps run under
  ``set_sync_debug_mode("error")``: one sync there fails the run.

``16-mixed`` with SGD is reported, not checked: GradScaler reads its overflow flag once per step
for an optimizer without a fused kernel, by design. ``16-mixed`` with a fused AdamW is checked:
GradScaler hands the kernel its flag and the kernel skips on the device, so no read is needed
(trainkit counts those skips on the device, read where the loop reads anyway). The other runs use
SGD: a non-fused Adam's step counters are CPU tensors that it reads on the host every step (no
device sync, but the patched count would see it).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.common import emit, row

HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")
CHECKED = ("32", "bf16-mixed", "16-mixed+fused")  # no read per step; 16-mixed with SGD has
# GradScaler's one
# the runs measured: (name, precision, optimizer)
RUNS = (("32", "32", "sgd"), ("bf16-mixed", "bf16-mixed", "sgd"), ("16-mixed", "16-mixed", "sgd"),
        ("16-mixed+fused", "16-mixed", "fused_adamw"))


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


SYNC_CALLS = ("tensor", "as_tensor", "synchronize", "Stream.synchronize", "Event.synchronize",
              "to (unpinned)", "cuda (unpinned)")


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    """The device a ``Tensor.to``/``.cuda`` call names, if any."""
    target = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))),
                                       None))
    return torch.device(target) if target is not None else None


@contextlib.contextmanager
def counting_host_syncs(device: torch.device | str) -> Iterator[Counter[str]]:
    """Count the calls that make the host wait for ``device`` (module docstring), by name."""
    device = torch.device(device)
    counts: Counter[str] = Counter()
    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, label: str, when: Any) -> None:
        method = getattr(owner, name)

        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            if when(args, kwargs):
                counts[label] += 1
            return method(*args, **kwargs)
        patches.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, call)

    def from_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        target = kwargs.get("device")
        return (target is not None and torch.device(target).type == device.type
                and not isinstance(args[0] if args else kwargs.get("data"), torch.Tensor))

    def unpinned(args: tuple[Any, ...], kwargs: dict[str, Any], cuda: bool = False) -> bool:
        self, target = args[0], _device_of(args[1:], kwargs)
        return (device.type == "cuda" and self.device.type == "cpu" and not self.is_pinned()
                and (cuda or (target is not None and target.type == "cuda")))

    always = lambda args, kwargs: True  # noqa: E731
    patch(torch, "tensor", "tensor", from_host)
    patch(torch, "as_tensor", "as_tensor", from_host)
    patch(torch.cuda, "synchronize", "synchronize", always)
    patch(torch.cuda.Stream, "synchronize", "Stream.synchronize", always)
    patch(torch.cuda.Event, "synchronize", "Event.synchronize", always)
    patch(torch.Tensor, "to", "to (unpinned)", unpinned)
    patch(torch.Tensor, "cuda", "cuda (unpinned)",
          lambda args, kwargs: unpinned(args, kwargs, cuda=True))
    try:
        yield counts
    finally:
        for owner, name, own in reversed(patches):  # as it was: defined there, or inherited
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)


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
              forward: Any = None, optimizer: str = "sgd") -> dict[str, Any]:
    """One ``Trainer.fit`` of ``steps`` steps over pre-placed batches (clipping, momentum, the
    NaN/inf check on, a forward with a scalar of its own), its host reads and syncs counted
    (:func:`counted_fit`); ``optimizer`` ``"sgd"`` or ``"fused_adamw"``."""
    device = torch.device(device)
    return counted_fit(_model(), _batches(steps, device), steps, log_every, device, precision,
                       forward=forward or with_own_scalar, optimizer=optimizer)


def counted_fit(model: nn.Module, data: Any, steps: int, log_every: int, device: torch.device,
                precision: str = "32", forward: Any = None,
                optimizer: str = "sgd", accumulate: int = 1) -> dict[str, Any]:
    """``Trainer.fit`` of ``steps`` steps on ``data`` with its host reads and host syncs
    counted; on CUDA also the syncs ``set_sync_debug_mode("warn")`` reports. On the CPU it runs
    the GPU's path (:func:`gpu_path_on_the_cpu`), which is what it is there to check."""
    from trainkit import Trainer, TrainerConfig

    config = TrainerConfig(device=str(device), max_epochs=10_000, max_steps=steps,
                           log_every_n_steps=log_every, log_every_n_seconds=0,
                           gradient_clip_val=1.0, precision=precision,
                           accumulate_grad_batches=accumulate)
    trainer = Trainer(config)
    kind, model = optimizer, model.to(device)
    optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
                 if kind == "fused_adamw" else
                 torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    cuda = device.type == "cuda"
    with counting_host_reads() as reads, counting_host_syncs(device) as host_syncs, \
            warnings.catch_warnings(record=True) as caught, \
            (contextlib.nullcontext() if cuda else gpu_path_on_the_cpu()):
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            summary = trainer.fit(model, optimizer, data, **({"forward": forward} if forward
                                                               else {}))
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    return {"steps": steps, "log_every": log_every, "precision": precision, "optimizer": kind,
            "host_reads": sum(reads.values()), "by_method": dict(reads),
            "host_syncs": sum(host_syncs.values()), "syncs_by_call": dict(host_syncs),
            "sync_warnings": len(syncs) if cuda else None,
            "first_sync": str(syncs[0].message)[:200] if syncs else None,
            "global_step": summary["global_step"]}


def image_folder(root: Path) -> Path:
    """A small image folder (JPEGs, EXIF-turned ones, PNGs, ...) made once under ``root``."""
    from tests.image_files import make_folder

    if not (root / "train").is_dir():
        make_folder(root, classes=2, per_class=12, val_per_class=1, sizes=(24, 40))
    return root


def loader_syncs(steps: int, log_every: int, device: torch.device | str, root: Path, *,
                 decode: str = "cpu", precision: str = "32") -> dict[str, Any]:
    """:func:`counted_fit` over the real loader of ``data=image_folder`` at ``root``: uint8
    batches through ``make_loader`` (pinned on CUDA), its collate and the ``DevicePrefetcher``,
    normalised on the device; ``decode="gpu"`` sends JPEG bytes to the ``JpegDecoder`` on
    ``device`` (on the CPU: libjpeg-turbo through the same list call)."""
    from trainkit.config import ImageFolderConfig
    from trainkit.core.runtime import Runtime
    from trainkit.data.pipeline import loaders_of
    from trainkit.data.sources import Options
    from trainkit.data.sources import image_folder as image_folder_source

    device = torch.device(device)
    cfg = ImageFolderConfig(name="image_folder", root=str(image_folder(root)), batch_size=2,
                            num_workers=0, image_size=16, decode=decode)
    # the source itself, not load_data, whose check refuses decode=gpu off CUDA to a user: here
    # the JpegDecoder's list call runs on the CPU on purpose
    runtime, options = Runtime(device), Options(seed=0)
    train, _, classes = loaders_of(image_folder_source.load(cfg, runtime, options), runtime,
                                   options)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, classes))
    result = counted_fit(model.to(device), train, steps, log_every, device, precision)
    return {"feed": f"image_folder loader, decode={decode}", **result}


class _TinyLM(nn.Module):
    """An embedding and a linear head: the smallest causal LM over ``input_ids``."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))


def text_forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    """As :func:`trainkit.models.hf.hf_forward` (without transformers): shifted, flattened
    logits and labels, padding -100."""
    logits = model(batch["input_ids"])
    return logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten()


def _count_text_targets(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["labels"][:, 1:] != -100).sum()  # as trainkit.models.hf.count_targets


text_forward.count_targets = _count_text_targets  # type: ignore[attr-defined]


def _texts(n: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """``n`` padded batches of 4 texts of 3-12 tokens: ``input_ids``, ``attention_mask``,
    ``labels`` (-100 at padding), as ``data=hf_text``'s collate makes them."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        lengths = torch.randint(3, 13, (4,), generator=g)
        mask = (torch.arange(12).unsqueeze(0) < lengths.unsqueeze(1)).long()
        ids = torch.randint(1, 32, (4, 12), generator=g) * mask
        out.append({"input_ids": ids.to(device), "attention_mask": mask.to(device),
                    "labels": ids.masked_fill(mask == 0, -100).to(device)})
    return out


def text_syncs(steps: int, log_every: int, device: torch.device | str,
               precision: str = "32", forward: Any = None) -> dict[str, Any]:
    """:func:`counted_fit` of padded text, 2 batches a step, with a forward that declares
    ``count_targets``: each window counted before its first backward (the token-normalised
    loss), its real tokens summed for ``throughput/tokens_per_s``, both on the device."""
    device = torch.device(device)
    torch.manual_seed(0)
    result = counted_fit(_TinyLM(), _texts(2 * steps, device), steps, log_every, device,
                         precision, forward=forward or text_forward, accumulate=2)
    return {"feed": "padded text, counted window of 2", **result}


def strict_window(device: torch.device, precision: str = "32",
                  optimizer: str = "sgd", text: bool = False) -> dict[str, Any]:
    """Steps 12-18 of a run logging every 10 under ``set_sync_debug_mode("error")`` (CUDA);
    ``text``: the counted padded-text feed (:func:`text_syncs`, 2 forwards a step)."""
    calls, per_step = 0, 2 if text else 1

    def forward(model: nn.Module, batch: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls in (11 * per_step + 1, 18 * per_step + 1):  # from step 12 to step 19's start
            torch.cuda.set_sync_debug_mode("error" if calls == 11 * per_step + 1 else "default")
        return text_forward(model, batch) if text else with_own_scalar(model, batch)

    if text:
        forward.count_targets = _count_text_targets  # type: ignore[attr-defined]
    try:
        if text:
            text_syncs(30, 10, device, precision, forward=forward)
        else:
            fit_reads(30, 10, device, precision, forward=forward, optimizer=optimizer)
    except RuntimeError as err:  # the sync that was refused
        return {"ok": False, "error": " ".join(str(err).split())[:300]}
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"ok": True}


COUNTS = ("host_reads", "host_syncs", "sync_warnings")


def _growth(name: str, runs: list[dict[str, Any]]) -> list[str]:
    """A failure for each count that differs between ``(N, L)`` and ``(2N, 2L)`` (same logs)."""
    failures = []
    for key in COUNTS:
        same_logs, more_steps = runs[0][key], runs[1][key]
        if same_logs is not None and same_logs != more_steps:
            failures.append(f"{name}: {key} grow with steps ({same_logs} over {runs[0]['steps']} "
                            f"steps, {more_steps} over {runs[1]['steps']}, same logs; "
                            f"{runs[1]['syncs_by_call'] or runs[1]['by_method']})")
    return failures


def measure(device: torch.device, steps: int = 40, log_every: int = 10, *,
            loader_steps: int = 6, loader_log_every: int = 3) -> dict[str, Any]:
    """For each precision, and for the real image loader (``decode`` cpu and gpu, one epoch of
    ``2 * loader_steps`` batches): runs of (N, L), (2N, 2L) -- as many logs -- and (2N, L)."""
    result: dict[str, Any] = {"benchmark": "syncs", "device": str(device), "by_precision": {},
                              "by_loader": {}, "by_text": {}}
    failures = []
    for name, precision, optimizer in RUNS:
        runs = [fit_reads(n, every, device, precision, optimizer=optimizer)
                for n, every in ((steps, log_every), (2 * steps, 2 * log_every),
                                 (2 * steps, log_every))]
        entry: dict[str, Any] = {"runs": runs}
        if name in CHECKED:
            failures += _growth(name, runs)
            if device.type == "cuda":
                entry["strict_window"] = strict_window(device, precision, optimizer)
                if not entry["strict_window"]["ok"]:
                    failures.append(f"{name}: a sync between logging steps: "
                                    f"{entry['strict_window']['error']}")
        result["by_precision"][name] = entry
    with tempfile.TemporaryDirectory(prefix="trainkit-syncs-") as folder:
        for decode in ("cpu", "gpu"):
            n, every = loader_steps, loader_log_every
            runs = [loader_syncs(k, e, device, Path(folder), decode=decode)
                    for k, e in ((n, every), (2 * n, 2 * every), (2 * n, every))]
            result["by_loader"][f"decode={decode}"] = {"runs": runs}
            failures += _growth(f"loader decode={decode}", runs)
    runs = [text_syncs(n, every, device) for n, every in ((steps, log_every),
                                                           (2 * steps, 2 * log_every),
                                                           (2 * steps, log_every))]
    entry = result["by_text"]["counted"] = {"runs": runs}
    failures += _growth("text counted", runs)
    if device.type == "cuda":
        entry["strict_window"] = strict_window(device, text=True)
        if not entry["strict_window"]["ok"]:
            failures.append(f"text counted: a sync between logging steps: "
                            f"{entry['strict_window']['error']}")
    result["failures"] = failures
    result["rows"] = [_row(f"{precision} host reads+syncs", entry["runs"],
                           precision in CHECKED, failures, precision)
                      for precision, entry in result["by_precision"].items()]
    result["rows"] += [_row(f"image loader {name}: host reads+syncs", entry["runs"], True,
                            failures, f"loader {name}")
                       for name, entry in result["by_loader"].items()]
    result["rows"].append(_row("padded text, counted window of 2: host reads+syncs",
                               result["by_text"]["counted"]["runs"], True, failures,
                               "text counted"))
    return result


def _row(name: str, runs: list[dict[str, Any]], checked: bool, failures: list[str],
         prefix: str) -> dict[str, Any]:
    grown = sum(runs[1][k] - runs[0][k] for k in ("host_reads", "host_syncs"))
    return row(f"syncs: {name} over {runs[1]['steps']} vs {runs[0]['steps']} steps (same logs)",
               grown, "0" if checked else "(GradScaler: one a step)",
               not any(f.startswith(prefix + ":") for f in failures) if checked else None,
               unit="calls")


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
