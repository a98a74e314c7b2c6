"""``trainkit estimate +exp=lm [overrides] [--device H100] [--world-size N]``: the peak memory
per rank of the run a config describes, before launching it, in seconds, without a GPU.

The model is built from the config as training builds it, on the ``meta`` device (no weights
allocated), with the optimizer, freezing, activation checkpointing, memory layout, precision,
accumulation and micro-batches the config sets; one steady-state step is traced
(:mod:`trainkit.observe.memory_estimate`). DDP adds its gradient buckets; FSDP's sharding over
``--world-size`` ranks is worked out from the traced figures (each rank a 1/N share of the
weights, gradients and optimizer state, plus the gathered units). It prints the parts, the peak
against the device's memory, the largest micro-batch that fits, and, when the run does not fit,
the settings that would make it fit. Exit status 0, or 2 on bad input (one line).
Guide: docs/memory.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from trainkit.config import TrainConfig
from trainkit.core.errors import ConfigError, TrainkitError
from trainkit.core.submodules import match_modules, repeated_blocks
from trainkit.data import SOURCES, source_of
from trainkit.distributed.fsdp import default_blocks, resolve_strategy
from trainkit.entry.build import build_criterion, build_forward, build_run_model, build_settings
from trainkit.entry.errors import errors_as_one_line
from trainkit.entry.train import CONFIG_DIR
from trainkit.loop.activations import split_policy
from trainkit.loop.precision import Hardware, Precision, choose_precision
from trainkit.loop.step import WindowStep
from trainkit.models.param_groups import apply_freeze, build_optimizer
from trainkit.observe.memory_estimate import (
    GIB,
    RunStep,
    StepMemory,
    StepSpec,
    casts_for,
    checkpoint_blocks,
    measure_step,
)

MIB = 2**20
# Total memory as nvidia-smi reports it (MiB), and whether the GPU has native bf16 (what
# trainer.precision=auto picks there: bf16-mixed, else 16-mixed).
DEVICES: dict[str, tuple[int, bool]] = {
    "h200": (143771, True), "h100": (81559, True), "h100-94gb": (95830, True),
    "a100-80gb": (81920, True), "a100-40gb": (40960, True), "a100": (81920, True),
    "l40s": (46068, True), "l40": (46068, True), "l4": (23034, True), "a10g": (23028, True),
    "a6000": (49140, True), "rtx4090": (24564, True), "rtx3090": (24576, True),
    "v100-32gb": (32768, False), "v100-16gb": (16384, False), "t4": (15360, False),
}
HEADROOM = 0.9  # of a GPU's memory a run may plan on: CUDA context, allocator, workspaces
MOST = 65536  # the largest micro-batch the search tries
TRACED_MICRO_BATCHES = 2  # a step's peak is reached by its second micro-batch at the latest



@dataclass(frozen=True)
class Target:
    """The device the estimate is for: its name, memory (bytes) and autocast's device type."""

    name: str
    total: int
    device_type: str
    bf16: bool

    @property
    def usable(self) -> int:
        return int(self.total * (HEADROOM if self.device_type == "cuda" else 1.0))


def main(argv: list[str] | None = None) -> int:
    """Run ``trainkit estimate``; return its exit status."""
    parser = argparse.ArgumentParser(
        prog="trainkit estimate", description="The peak memory per rank of a configured run, "
        "and what would make it fit a device, without a GPU. Guide: docs/memory.md")
    parser.add_argument("--device", default=None, help="the GPU to size for "
                        f"({', '.join(DEVICES)}), or cpu; default: this machine's GPU, else cpu")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks the run trains on (default: WORLD_SIZE, else 1)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("overrides", nargs="*", help="the overrides you pass to trainkit train")
    args = parser.parse_intermixed_args(argv)
    with errors_as_one_line():
        target = find_target(args.device)
        world = args.world_size if args.world_size is not None else int(
            os.environ.get("WORLD_SIZE", "1"))
        if world < 1:
            raise TrainkitError(f"--world-size must be >= 1, got {world}")
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cfg = compose("train", overrides=args.overrides)
        report = estimate(cfg, target, world)
        print(render(report))
        if args.json is not None:
            try:
                args.json.write_text(json.dumps(report, indent=2) + "\n")
            except OSError as err:
                raise TrainkitError(f"--json {args.json}: cannot write there "
                                    f"({err.strerror}); give a path in a folder you can "
                                    "write to") from None
    return 0


def find_target(name: str | None) -> Target:
    """The device ``--device`` names (case and spaces ignored), or this machine's."""
    if name is None:
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            major = torch.cuda.get_device_capability(0)[0]
            return Target(props.name, props.total_memory, "cuda", major >= 8)
        name = "cpu"
    key = name.lower().replace(" ", "").replace("_", "-")
    if key == "cpu":
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return Target("cpu", pages, "cpu", False)
    if key not in DEVICES:
        raise TrainkitError(f"--device {name}: not a device this table knows; use one of "
                            f"{', '.join(DEVICES)} or cpu")
    mib, bf16 = DEVICES[key]
    return Target(key, mib * MIB, "cuda", bf16)


def estimate(cfg: DictConfig, target: Target, world: int) -> dict[str, Any]:
    """The run's memory per rank on ``target`` over ``world`` ranks, and what fits."""
    assumed = _assumed_vocabulary(cfg)  # before _settings sets it
    settings = _settings(cfg)
    plan = MemoryPlan.of(cfg, settings, target, world)
    memory = plan.trace(plan.micro_batch)
    peak = plan.per_rank(memory)
    strategy = plan.strategy if world > 1 or plan.strategy == "fsdp" else "one process"
    report = {"device": target.name, "device_gib": target.total / GIB, "world_size": world,
              "strategy": strategy, "precision": plan.precision,
              "batch_size": plan.batch, "micro_batch_size": plan.micro_batch,
              "micro_batches_per_step": plan.steps, "parts_gib": plan.parts(memory),
              "peak_gib": peak / GIB, "usable_gib": target.usable / GIB,
              "fits": peak <= target.usable}
    report["notes"] = [*assumed, *plan.notes()]
    report["largest_micro_batch"] = plan.largest_micro_batch()
    report["suggestions"] = [] if report["fits"] else plan.suggestions(
        memory, report["largest_micro_batch"])
    return report


def _settings(cfg: DictConfig) -> TrainConfig:
    """The typed settings, ``data.num_classes`` set first where the data's name tells it."""
    data = cfg.data
    if cfg.get("dataset") is not None:
        raise ConfigError("dataset._target_: the estimate makes batches of the built-in data "
                          "only; give data=image_folder (or tokens) with your data's "
                          "data.image_size, data.channels and data.num_classes instead")
    source = source_of(data.name)
    if not source.estimable():
        raise ConfigError(f"data={data.name}: the estimate knows the built-in image and token "
                          f"data ({', '.join(n for n, s in SOURCES.items() if s.estimable())})")
    if OmegaConf.is_missing(data, "root"):  # not read here: an image folder's is required
        with open_dict(cfg):
            cfg.data.root = "."
    if data.get("num_classes") is None:
        known = (source.known_classes(str(cfg.data.get("root") or "."))
                 or _tokenizer_vocabulary(cfg, source))
        if known is None:
            raise ConfigError(f"data={data.name}: the estimate does not read the data; set "
                              "data.num_classes (its classes, or a token corpus's vocabulary)")
        with open_dict(cfg):
            cfg.data.num_classes = known
    return build_settings(cfg)


# The vocabularies of `python -m trainkit.data tokenize --tokenizer ...` (bytes: its default).
VOCABULARIES = {"bytes": 256, "gpt2": 50257}


def _tokenizer_vocabulary(cfg: DictConfig, source: Any) -> int | None:
    """A token corpus's vocabulary where its files do not say it: the tokenizer the config's
    sample callback names (``+exp=lm``: bytes), else ``tokenize``'s default, bytes."""
    if source.takes != "tokens":
        return None
    sample = (cfg.get("callbacks") or {}).get("sample") or {}
    return VOCABULARIES.get(str(sample.get("tokenizer", "bytes")))


def _assumed_vocabulary(cfg: DictConfig) -> list[str]:
    """The note for a vocabulary taken from the tokenizer's name, not the corpus."""
    if cfg.get("dataset") is not None:
        return []  # refused by _settings, in its words
    try:
        source = source_of(cfg.data.name)
    except ConfigError:
        return []  # an unknown data.name: refused by _settings, in its words
    if (cfg.data.get("num_classes") is not None
            or source.known_classes(str(cfg.data.get("root") or ".")) is not None
            or (vocab := _tokenizer_vocabulary(cfg, source)) is None):
        return []
    return [f"data.num_classes={vocab} assumed (the tokenizer's vocabulary; no meta.json under "
            "data.root): set data.num_classes for another"]


def sample_batch(settings: TrainConfig, size: int, device: str = "meta") -> Callable[[], Any]:
    """A maker of batches of ``size`` samples as the configured data gives them to the step
    (the source's :meth:`~trainkit.data.Source.example_batch`)."""
    return source_of(settings.data.name).example_batch(
        settings.data, size, channels_last=settings.trainer.channels_last, device=device)


def traced_step(model: nn.Module, optimizer: torch.optim.Optimizer, spec: StepSpec) -> RunStep:
    """trainkit's own step (:class:`~trainkit.loop.step.WindowStep`, the loop's) as the trace
    runs it on meta tensors, where autocast does nothing: the forward and the loss run under
    autocast's casts (:func:`~trainkit.observe.memory_estimate.casts_for`), the rest as fp32's
    step (a loss scaler holds a few scalars). ``update`` False: the optimizer's update left
    out (:class:`_NoUpdate`)."""

    def forward(model: nn.Module, batch: Any) -> Any:
        with casts_for(spec):
            return spec.forward(model, batch)

    def criterion(outputs: Any, targets: Any) -> Any:
        with casts_for(spec):
            return spec.criterion(outputs, targets)

    def step(opt: Any) -> WindowStep:
        return WindowStep(model, optimizer=opt, precision=Precision("32"), criterion=criterion,
                          forward=forward, device=torch.device("meta"),
                          clip_val=1.0 if spec.clip else None)

    steps = {True: step(optimizer), False: step(_NoUpdate(optimizer))}
    return lambda window, update: steps[update](window)


class _NoUpdate:
    """An optimizer whose step updates nothing, for a fused kernel's (it allocates nothing; on
    meta tensors the per-tensor loop would): gradients still dropped after it."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.param_groups = optimizer.param_groups

    def step(self) -> None:
        """Nothing: the update is left out of the trace."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                param.grad = None


class MemoryPlan:
    """A run's config turned into what the trace needs, and the sums over ranks."""

    def __init__(self, cfg: DictConfig, settings: TrainConfig, target: Target, world: int,
                 precision: str) -> None:
        self.cfg, self.settings, self.target, self.world = cfg, settings, target, world
        trainer = settings.trainer
        self.precision, self.batch = precision, settings.data.batch_size
        self.strategy = resolve_strategy(trainer.strategy, world)
        size = trainer.micro_batch_size
        self.micro_batch = size if isinstance(size, int) and size < self.batch else self.batch
        self.steps = self.micro_batches(self.micro_batch)
        self.checkpointed = _selectors(trainer.activation_checkpointing)
        self.fused = False  # the optimizer's config asks for a fused kernel (set by build)
        # data.loader=memory on a GPU: the uint8 splits live there (trainkit.data.memory)
        self.resident = (source_of(settings.data.name).resident_bytes
                         if target.device_type == "cuda" and settings.data.loader == "memory"
                         else 0)

    def micro_batches(self, size: int) -> int:
        """Micro-batches an optimizer step takes at ``size`` samples each."""
        accumulate = self.settings.trainer.accumulate_grad_batches
        return accumulate * math.ceil(self.batch / min(size, self.batch))

    @classmethod
    def of(cls, cfg: DictConfig, settings: TrainConfig, target: Target, world: int) -> MemoryPlan:
        precision = settings.trainer.precision
        if precision == "auto":
            precision = (("bf16-mixed" if target.bf16 else "16-mixed") if target.device_type
                         == "cuda" else choose_precision(Hardware.of("cpu"))[0])
        return cls(cfg, settings, target, world, precision)

    def build(self, checkpointed: list[str]) -> tuple[nn.Module, Any, list[str]]:
        """The model (on meta), its optimizer, and the checkpointed modules' names."""
        with torch.device("meta"):
            data = self.settings.data
            model = build_run_model(self.cfg, data.num_classes, channels=data.channels,
                                pretrained=False)
        node = OmegaConf.to_container(self.cfg.optim, resolve=True)
        fused = self.fused = bool(node.get("fused"))
        node["fused"] = None  # no fused kernels on meta: the per-tensor loop, or foreach
        if "foreach" in node or node.get("_target_", "").startswith("torch.optim."):
            # torch's default on CUDA (foreach) makes temporaries a fused kernel does not
            node["foreach"] = self.target.device_type == "cuda" and not fused and node.get(
                "foreach") is not False
        optimizer = build_optimizer(model, node, lambda n, groups: instantiate(
            n, params=groups, _convert_="all"))
        apply_freeze(model, self.settings.trainer, 0)
        if checkpointed == ["*"]:  # full or selective alone: the blocks training checkpoints
            names = repeated_blocks(model)
        else:
            names = (match_modules(model, checkpointed, "trainer.activation_checkpointing")
                     if checkpointed else [])
        checkpoint_blocks(model, names, self.precision, self.target.device_type)
        if self.settings.trainer.channels_last and self.strategy != "fsdp":
            model = model.to(memory_format=torch.channels_last)
        return model.train(), optimizer, names

    def trace(self, micro_batch: int, checkpointed: list[str] | None = None,
              micro_batches: int | None = None) -> StepMemory:
        """One steady-state step at ``micro_batch`` samples a micro-batch (``micro_batches`` of
        them traced: by default as many as the batch makes, up to TRACED_MICRO_BATCHES)."""
        model, optimizer, _ = self.build(self.checkpointed if checkpointed is None
                                         else checkpointed)
        extra = ([t.detach().clone() for t in [*model.parameters(), *model.buffers()]]
                 if self.settings.trainer.ema_decay else [])
        spec = StepSpec(build_forward(self.cfg), build_criterion(self.cfg),
                        micro_batches=micro_batches or min(self.micro_batches(micro_batch),
                                                           TRACED_MICRO_BATCHES),
                        precision=self.precision, device_type=self.target.device_type,
                        clip=self.settings.trainer.gradient_clip_val is not None, extra=extra,
                        fused=self.fused)
        memory = measure_step(model, optimizer, sample_batch(self.settings, micro_batch),
                              spec, traced_step(model, optimizer, spec))
        memory.blocks = _block_bytes(model)
        return memory

    def per_rank(self, memory: StepMemory, world: int | None = None,
                 strategy: str | None = None) -> int:
        """The peak on each rank: the traced one, DDP's buckets added, or FSDP's shares."""
        world, strategy = world or self.world, strategy or self.strategy
        if strategy == "ddp" and world > 1:  # gradient buckets (a copy of the gradients)
            return memory.peak + memory.grads + self.resident
        if strategy != "fsdp":
            return memory.peak + self.resident
        ema = memory.params if self.settings.trainer.ema_decay else 0  # a copy, sharded alike
        shard = memory.params + memory.grads + memory.optimizer_state + ema
        shard += (memory.extra - ema) * world  # the batch: each rank's whole
        root, largest = memory.blocks
        scale = 0.5 if self.precision != "32" else 1.0  # gathered in the low precision
        gathered = int((root + 2 * largest) * scale) + largest  # + one unit's full gradients
        return memory.activations + shard // world + gathered + self.resident

    def notes(self) -> list[str]:
        """What the figures stand for where they are not a traced step's."""
        trainer, notes = self.settings.trainer, []
        if self.strategy == "fsdp":
            notes.append("FSDP's shares are worked out from the traced single-rank step")
        if trainer.compile:
            notes.append("trainer.compile: the eager step's memory (a compiled one often "
                         "needs less)")
        if "selective" in trainer.activation_checkpointing:
            notes.append("activation_checkpointing=selective: estimated as full checkpointing "
                         "(selective keeps more: this is its lower bound)")
        return notes

    def parts(self, memory: StepMemory) -> dict[str, float]:
        share = self.world if self.strategy == "fsdp" else 1
        ema = memory.params if self.settings.trainer.ema_decay else 0
        parts = {"parameters": memory.params / share, "gradients": memory.grads / share,
                 "optimizer_state": memory.optimizer_state / share,
                 "activations_and_temporaries": memory.activations,
                 "batch_and_ema": memory.extra - ema + ema / share,
                 "data_on_the_device": self.resident}
        return {k: v / GIB for k, v in parts.items()}

    def largest_micro_batch(self) -> int | None:
        """The most samples a micro-batch can have within the usable memory: the boundary
        where a traced step stops fitting, found by bracketing and bisection. Each size is
        traced as a step of several micro-batches (a batch split into them, gradients
        accumulating), whatever the configured batch: the answer is the same from any batch (a
        linear fit of two traces only picks where to look first). None if not even one sample
        fits, :data:`MOST` if that many fit."""
        traced: dict[int, int] = {}

        def fits(size: int) -> bool:
            if size not in traced:
                traced[size] = self.per_rank(self.trace(
                    size, micro_batches=TRACED_MICRO_BATCHES))
            return traced[size] <= self.target.usable

        low = max(1, self.micro_batch // 2) if self.micro_batch > 1 else 2
        fits(self.micro_batch)
        fits(low)
        slope = (traced[self.micro_batch] - traced[low]) / (self.micro_batch - low)
        base = traced[self.micro_batch] - slope * self.micro_batch
        guess = min(int((self.target.usable - base) / slope) if slope > 0 else MOST, MOST)
        guess = max(1, guess)
        if fits(guess):  # bracket: lo fits, hi does not
            lo, hi = guess, min(MOST, guess + max(1, guess // 32))
            while hi > lo and fits(hi):
                if hi == MOST:
                    return MOST
                lo, hi = hi, min(MOST, 2 * hi)
        else:
            hi, lo = guess, max(1, guess - max(1, guess // 32))
            while not fits(lo):
                if lo == 1:
                    return None
                hi, lo = lo, max(1, lo // 2)
        while hi - lo > 1:
            middle = (lo + hi) // 2
            lo, hi = (middle, hi) if fits(middle) else (lo, middle)
        return lo

    def suggestions(self, memory: StepMemory, largest: int | None) -> list[str]:
        """Settings that make a run fit that does not: each checked by its own figures."""
        found, usable = [], self.target.usable
        if largest:
            found.append(f"trainer.micro_batch_size={largest}")
        if not self.checkpointed:
            model, _, _ = self.build([])
            block = repeated_block(model)
            if block and self.per_rank(self.trace(self.micro_batch, [block])) <= usable:
                found.append(f"trainer.activation_checkpointing=[{block}]")
        if self.precision == "32" and self.target.device_type == "cuda":
            mixed = "bf16-mixed" if self.target.bf16 else "16-mixed"
            lower = MemoryPlan(self.cfg, self.settings, self.target, self.world, mixed)
            if lower.per_rank(lower.trace(self.micro_batch)) <= usable:
                found.append(f"trainer.precision={mixed}")
        for ranks in (r for r in (2, 4, 8, 16, 32, 64) if r > self.world):
            if self.per_rank(memory, ranks, "fsdp") <= usable:
                found.append(f"trainer.strategy=fsdp over {ranks} ranks")
                break
        return found


CONTAINERS = (torch.nn.Sequential, nn.ModuleList, nn.ModuleDict)
LAYERS = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d,
          nn.ConvTranspose2d, nn.ConvTranspose3d, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
          nn.LayerNorm, nn.GroupNorm)


def repeated_block(model: nn.Module) -> str | None:
    """The class name of the model's repeated block worth checkpointing: of the classes with
    parameters (not containers or single layers) that occur at least twice, outermost instances
    of each, the one holding the most parameters in all (a transformer's layer, a ResNet's
    bottleneck)."""
    paths: dict[str, list[str]] = {}
    totals: dict[str, int] = {}
    for name, module in model.named_modules():
        cls = type(module).__name__
        if not name or isinstance(module, (*CONTAINERS, *LAYERS)) or any(
                name.startswith(p + ".") for p in paths.get(cls, [])):
            continue
        size = sum(p.numel() for p in module.parameters())
        if size:
            paths.setdefault(cls, []).append(name)
            totals[cls] = totals.get(cls, 0) + size
    repeated = [cls for cls, found in paths.items() if len(found) >= 2]
    return max(repeated, key=lambda cls: totals[cls]) if repeated else None


def _selectors(value: list[str]) -> list[str]:
    """``trainer.activation_checkpointing`` (as the config normalises it) as module selectors:
    the modules it names; a policy word alone: the model's repeated blocks, marked ``*``; off:
    none. A selective policy saves some of what full recomputes: its estimate is full's, a
    lower bound."""
    return (split_policy(value)[1] or ["*"]) if value else []


def _block_bytes(model: nn.Module) -> tuple[int, int]:
    """Bytes of the parameters outside FSDP's blocks (the root unit) and of the largest block."""
    modules = dict(model.named_modules())
    sizes = [sum(p.numel() * p.element_size() for p in modules[name].parameters())
             for name in default_blocks(model)]
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - sum(sizes), max(sizes, default=0)


def render(report: dict[str, Any]) -> str:
    """The report as lines: the setting, the parts, the peak, the verdict."""
    gib = report["device_gib"]
    lines = [f"trainkit estimate: {report['device']} ({gib:.1f} GiB), {report['world_size']} "
             f"rank(s), {report['strategy']}, precision {report['precision']}, batch "
             f"{report['batch_size']} a rank in micro-batches of {report['micro_batch_size']} "
             f"({report['micro_batches_per_step']} a step)"]
    for name, value in report["parts_gib"].items():
        if name == "data_on_the_device" and not value:
            continue
        lines.append(f"  {name.replace('_', ' '):<30}{value:>10.3f} GiB")
    lines.append(f"  {'peak per rank':<30}{report['peak_gib']:>10.3f} GiB "
                 f"({report['peak_gib'] / gib:.0%} of the device)")
    lines += [f"note: {note}" for note in report["notes"]]
    largest = report["largest_micro_batch"]
    most = ("not even a micro-batch of one sample fits" if not largest else
            f"micro-batches of {MOST} samples (the most tried) fit" if largest >= MOST else
            f"micro-batches of up to {largest} samples fit")
    if report["fits"]:
        lines.append(f"verdict: fits ({report['peak_gib']:.2f} of {report['usable_gib']:.1f} "
                     f"GiB usable); {most}")
    else:
        ways = "; ".join(report["suggestions"]) or "none of micro-batches, activation " \
            "checkpointing or FSDP up to 64 ranks"
        lines.append(f"verdict: does not fit ({report['peak_gib']:.2f} GiB > "
                     f"{report['usable_gib']:.1f} GiB usable); {most}; fits with: {ways}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
