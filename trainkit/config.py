"""Typed settings with range checks. Plain dataclasses: usable without Hydra.

The Hydra entry point registers these as structured configs, so a wrong *type* fails while
composing; ``__post_init__`` checks *ranges* and runs both from Python and when Hydra's config is
turned into these objects (``OmegaConf.to_object``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainkit.core.errors import ConfigError

# The choices of the settings that take one of a few words (checked by _check_choice)
PRECISIONS = ("auto", "32", "bf16-mixed", "16-mixed")
CLIP_ALGORITHMS = ("norm", "value")
PAD_MODES = ("constant", "reflect")
HANG_ACTIONS = ("report", "abort")
STRATEGIES = ("auto", "ddp", "fsdp")
DECODERS = ("cpu", "gpu")  # image folders' JPEGs: in the loader's workers, or nvJPEG on CUDA
LOADERS = ("memory", "dataloader")
AUTO_AUGMENTS = ("randaugment", "trivialaugment")  # data.auto_augment: torchvision's
MONITOR_MODES = ("max", "min")
# trainer.activation_checkpointing's policies (trainkit.loop.activations): full recomputes a
# block's whole forward in backward; selective keeps its matmul/attention outputs
CHECKPOINT_POLICIES = ("full", "selective")
COMPILE_MODES = (False, True, "regional")  # regional: each repeated block (trainer.compile)


@dataclass
class ProfileConfig:
    """``trainer.profile``: torch.profiler on a schedule for chosen ranks (observe/profile.py).

    Each cycle skips ``wait`` steps, warms up ``warmup`` and records ``active``; ``repeat``
    cycles (0: until the run ends). ``memory_snapshot``: CUDA allocations recorded (Python
    stacks) in the active steps, a snapshot at each window's end and at an out-of-memory error.
    """

    enabled: bool = False
    wait: int = 5
    warmup: int = 2
    active: int = 3
    repeat: int = 1
    ranks: list[int] = field(default_factory=lambda: [0])
    memory_snapshot: bool = False
    top_ops: int = 5  # train.log lines: the operators with the most self time

    def __post_init__(self) -> None:
        _check_bool("trainer.profile.enabled", self.enabled)
        _check_bool("trainer.profile.memory_snapshot", self.memory_snapshot)
        for name in ("wait", "warmup", "repeat", "top_ops"):
            _check_int(f"trainer.profile.{name}", getattr(self, name), minimum=0)
        _check_int("trainer.profile.active", self.active, minimum=1)
        self.ranks = list(self.ranks)
        if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0
                   for r in self.ranks):
            raise ConfigError(f"trainer.profile.ranks must be a list of ranks (e.g. [0]), got "
                              f"{self.ranks!r}")


@dataclass
class SpikeConfig:
    """``trainer.spike``: roll back to the last good state on a loss spike (loop/spike.py).

    A spike: a loss above the mean + ``threshold`` standard deviations of the last ``window``
    finite ones (after ``warmup``), or ``max_nonfinite`` NaN/inf in a row. The run goes back to its
    snapshot (every ``snapshot_every`` steps), trains ``lr_steps`` steps at ``lr_factor`` times the
    LR, and stops (``diverged``) after ``max_rollbacks`` within ``rollback_window`` steps.
    """

    enabled: bool = False
    window: int = 100
    threshold: float = 6.0
    warmup: int = 50
    max_nonfinite: int = 3  # 0: NaN/inf losses are left to trainer.nonfinite_patience
    snapshot_every: int = 50
    max_rollbacks: int = 3
    rollback_window: int = 1000
    lr_factor: float = 1.0
    lr_steps: int = 0

    def __post_init__(self) -> None:
        _check_bool("trainer.spike.enabled", self.enabled)
        for name, minimum in (("window", 2), ("warmup", 2), ("max_nonfinite", 0),
                              ("snapshot_every", 1), ("max_rollbacks", 0),
                              ("rollback_window", 1), ("lr_steps", 0)):
            _check_int(f"trainer.spike.{name}", getattr(self, name), minimum=minimum)
        for name, low, high in (("threshold", 0.0, float("inf")), ("lr_factor", 0.0, 1.0)):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not low < value <= high):
                raise ConfigError(f"trainer.spike.{name} must be a number in ({low:g}, {high:g}]"
                                  f", got {value!r}")


@dataclass
class TrainerConfig:
    """How to train. ``max_steps`` counts optimizer steps; -1 means no step limit.
    ``max_epochs``: null is one epoch, or no epoch limit when ``max_steps`` is set (Lightning's
    rule: ``max_steps`` alone is then the run's length); :attr:`epoch_limit` is what counts."""

    max_epochs: int | None = None
    max_steps: int = -1
    precision: str = "32"
    accumulate_grad_batches: int = 1
    # each batch split into micro-batches of this many samples, accumulated into the same step;
    # auto: the whole batch, halved on CUDA out-of-memory (trainkit.loop.micro_batch); null: off
    micro_batch_size: Any = None
    # the loss compares a batch's samples (contrastive NT-Xent, batch statistics): k batches of b
    # are not one batch of k*b, so micro_batch_size (auto or a number) is refused
    in_batch_loss: bool = False
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    device: str = "auto"
    seed: int = 0  # fit seeds training's draws from it; the entry point also the model's init
    # true: the whole model; regional: each repeated block (transformer layers, ResNet stages),
    # compiled once for all instances of its class (trainkit.distributed.strategy.compiled)
    compile: Any = False
    channels_last: bool = False
    cudnn_benchmark: bool = True  # CUDA: autotune convolution algorithms per input shape
    tf32: bool = True  # CUDA, Ampere+: float32 matmuls and convolutions in TF32
    # CPU runs: glibc keeps freed memory for the next step instead of unmapping it (no page
    # faults per step; see trainkit.core.cpu_settings). Process-wide: once on, on until the exit.
    cpu_keep_freed_memory: bool = True
    # off ([], null, false), full or selective (the model's repeated blocks), or a list of module
    # class names/paths, recomputed in full, or with `selective` among them (loop/activations.py)
    activation_checkpointing: Any = field(default_factory=list)
    # fine-tuning (trainkit.models.param_groups): parameters frozen by glob patterns on their
    # names, until epoch unfreeze_at_epoch (1: after the first epoch; null: frozen throughout)
    freeze: list[str] = field(default_factory=list)
    unfreeze_at_epoch: int | None = None
    # auto: DDP over several ranks; fsdp: weights, gradients and optimizer state sharded (FSDP2)
    strategy: str = "auto"
    fsdp_blocks: list[str] = field(default_factory=list)  # sharded units; empty: repeated blocks
    fsdp_reshard_after_forward: bool = True  # free gathered weights after forward (less memory)
    log_every_n_steps: int = 50
    log_every_n_seconds: float = 60.0  # also log when this long passed (slow steps); 0: off
    eval_every_n_epochs: int = 1
    eval_every_n_steps: int | None = None  # also evaluate every n optimizer steps; null: off
    eval_max_batches: int | None = None  # n batches spread evenly over the split; null: all
    ema_decay: float | None = None  # e.g. 0.999: evaluate (and checkpoint) an EMA of the weights
    nonfinite_patience: int = 5  # stop after this many NaN/inf losses in a row; 0: no check
    hang_timeout_s: float | None = None  # no step this long: dump stacks; null: auto; 0: off
    hang_action: str = "report"  # or "abort": exit with status 124 (torchrun restarts)
    # One train.log line (and summary.json `advice`) when the run waits on its data, nears the
    # device's memory limit or reads the device every step (trainkit.observe.advice)
    advice: bool = True
    # Under SLURM only: after a SIGUSR1 stop's checkpoint, rank 0 runs `scontrol requeue <job>`
    # (trainkit.distributed.slurm_requeue); false: exit 75 and leave resubmitting to you
    slurm_requeue: bool = True
    # the device's peak TFLOP/s for the run's precision, MFU's denominator (trainkit.observe.
    # flops); null: a GPU's datasheet figure, else a matmul measured once per process
    peak_tflops: float | None = None
    profile: ProfileConfig = field(default_factory=ProfileConfig)  # off unless enabled
    spike: SpikeConfig = field(default_factory=SpikeConfig)  # loss-spike rollback; off

    def __post_init__(self) -> None:
        if isinstance(self.profile, Mapping):  # from a plain dict (a library user's, a test's)
            self.profile = ProfileConfig(**self.profile)
        if isinstance(self.spike, Mapping):
            self.spike = SpikeConfig(**self.spike)
        if self.max_epochs is not None:
            _check_int("trainer.max_epochs", self.max_epochs, minimum=1)
        _check_int("trainer.max_steps", self.max_steps, minimum=-1)
        if self.max_steps == 0:
            raise ConfigError("trainer.max_steps=0 trains nothing: use a positive number or -1")
        self.precision = str(self.precision)
        _check_choice("trainer.precision", self.precision, PRECISIONS)
        _check_int("trainer.accumulate_grad_batches", self.accumulate_grad_batches, minimum=1)
        if not (self.micro_batch_size is None or self.micro_batch_size == "auto" or (
                isinstance(self.micro_batch_size, int) and not isinstance(
                    self.micro_batch_size, bool) and self.micro_batch_size >= 1)):
            raise ConfigError(f"trainer.micro_batch_size={self.micro_batch_size!r}: use auto, a "
                              "number of samples >= 1, or null (the whole batch)")
        _check_bool("trainer.in_batch_loss", self.in_batch_loss)
        if self.in_batch_loss and self.micro_batch_size is not None:
            raise ConfigError(f"trainer.micro_batch_size={self.micro_batch_size} would split "
                              "batches, which changes an in-batch loss (trainer.in_batch_loss="
                              "true): set it to null; for memory, lower data.batch_size")
        if self.gradient_clip_val is not None and not self.gradient_clip_val > 0:
            raise ConfigError(
                f"trainer.gradient_clip_val must be > 0 or null, got {self.gradient_clip_val}"
            )
        _check_choice("trainer.gradient_clip_algorithm", self.gradient_clip_algorithm,
                      CLIP_ALGORITHMS)
        _check_int("trainer.seed", self.seed, minimum=0)
        _check_int("trainer.log_every_n_steps", self.log_every_n_steps, minimum=1)
        _check_int("trainer.eval_every_n_epochs", self.eval_every_n_epochs, minimum=1)
        if self.eval_every_n_steps is not None:
            _check_int("trainer.eval_every_n_steps", self.eval_every_n_steps, minimum=1)
        if self.eval_max_batches is not None:
            _check_int("trainer.eval_max_batches", self.eval_max_batches, minimum=0)
            if self.eval_max_batches == 0:
                raise ConfigError("trainer.eval_max_batches=0 evaluates nothing: use a positive "
                                  "number of batches, or null for all")
        if isinstance(self.log_every_n_seconds, bool) or not self.log_every_n_seconds >= 0:
            raise ConfigError(
                f"trainer.log_every_n_seconds must be >= 0, got {self.log_every_n_seconds!r}"
            )
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ConfigError(f"trainer.ema_decay must be in (0, 1) or null, got {self.ema_decay}")
        _check_int("trainer.nonfinite_patience", self.nonfinite_patience, minimum=0)
        streak, patience = self.spike.max_nonfinite, self.nonfinite_patience
        if self.spike.enabled and streak and patience and streak > patience - 2:
            raise ConfigError(  # a rollback may come a step after the streak was seen
                f"trainer.spike.max_nonfinite={streak} must be at most trainer.nonfinite_patience"
                f" - 2 = {patience - 2}, or the run stops before it rolls back: lower it or "
                "raise trainer.nonfinite_patience")
        _check_bool("trainer.cudnn_benchmark", self.cudnn_benchmark)
        _check_bool("trainer.tf32", self.tf32)
        _check_bool("trainer.cpu_keep_freed_memory", self.cpu_keep_freed_memory)
        timeout = self.hang_timeout_s
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(
                timeout, (int, float)) or not timeout >= 0):
            raise ConfigError(f"trainer.hang_timeout_s must be >= 0 (0: off) or null (automatic), "
                              f"got {self.hang_timeout_s!r}")
        _check_choice("trainer.hang_action", self.hang_action, HANG_ACTIONS)
        self.activation_checkpointing = _checkpointing(self.activation_checkpointing)
        self.compile = _compile_mode(self.compile)
        self.freeze = list(self.freeze)
        if self.unfreeze_at_epoch is not None:
            _check_int("trainer.unfreeze_at_epoch", self.unfreeze_at_epoch, minimum=1)
            if not self.freeze:
                raise ConfigError("trainer.unfreeze_at_epoch needs trainer.freeze: name the "
                                  "parameters to freeze until then, e.g. trainer.freeze=[layer*]")
        _check_choice("trainer.strategy", self.strategy, STRATEGIES)
        self.fsdp_blocks = list(self.fsdp_blocks)
        if not all(isinstance(name, str) and name for name in self.fsdp_blocks):
            raise ConfigError(f"trainer.fsdp_blocks must be a list of module class names or "
                              f"paths, got {self.fsdp_blocks!r}")
        _check_bool("trainer.fsdp_reshard_after_forward", self.fsdp_reshard_after_forward)
        _check_bool("trainer.advice", self.advice)
        _check_bool("trainer.slurm_requeue", self.slurm_requeue)
        peak = self.peak_tflops
        if peak is not None and (isinstance(peak, bool) or not isinstance(peak, (int, float))
                                 or not peak > 0):
            raise ConfigError(f"trainer.peak_tflops must be a number > 0 (the device's peak "
                              f"TFLOP/s) or null, got {self.peak_tflops!r}")

    @property
    def epoch_limit(self) -> int:
        """The epochs the loop may run: ``max_epochs``, else 1 without ``max_steps`` and no
        limit (``sys.maxsize``) with it."""
        if self.max_epochs is not None:
            return self.max_epochs
        return 1 if self.max_steps < 0 else sys.maxsize


@dataclass
class SharedDataConfig:
    """What every source reads: where the data is and how it is batched (the seed is the
    trainer's). A source's typed config is this plus its own fields below; the checks of each
    part run when a config is made."""

    name: str = "mnist"
    root: str = field(default_factory=lambda: os.environ.get("TRAINKIT_DATA_DIR", "./data"))
    batch_size: int = 128
    eval_batch_size: int = 1000
    num_workers: int | None = None  # loader workers; null: from the CPUs per process
    pin_memory: bool | None = None  # null: on exactly when training on CUDA
    drop_last: bool = False  # training loader: drop a short last batch
    # Known once the data is read (an image folder's class folders); model and metrics configs
    # take it as ${data.num_classes}. null: from the data; a number: checked against the data.
    num_classes: int | None = None

    def __post_init__(self) -> None:
        for part in reversed(type(self).__mro__):  # each part's own checks, once
            check = part.__dict__.get("_check")
            if check is not None:
                check(self)

    def _check(self) -> None:
        _check_int("data.batch_size", self.batch_size, minimum=1)
        _check_int("data.eval_batch_size", self.eval_batch_size, minimum=1)
        if self.num_workers is not None:
            _check_int("data.num_workers", self.num_workers, minimum=0)
        if self.num_classes is not None:
            _check_int("data.num_classes", self.num_classes, minimum=1)


@dataclass
class TensorFields:
    """``data=mnist`` / ``data=cifar10`` (and a reader's ``TensorData``): the files' checks and
    the in-memory loader's batch augmentation on the device."""

    loader: str = "memory"  # memory: batches gathered on the device; dataloader: the standard path
    verify: bool = True
    download: bool = True
    # Random translation by up to this many pixels (random crop with padding; 0: off) and
    # horizontal flips; what translation uncovers: constant (zeros) or reflect.
    random_crop_padding: int = 0
    random_flip: bool = False
    pad_mode: str = "constant"

    def _check(self) -> None:
        _check_choice("data.loader", self.loader, LOADERS)
        _check_int("data.random_crop_padding", self.random_crop_padding, minimum=0)
        if self.pad_mode not in PAD_MODES:
            raise ConfigError(f"data.pad_mode={self.pad_mode!r} is not one of "
                              f"{', '.join(PAD_MODES)}")


@dataclass
class ImageFields:
    """Image files (``data=image_folder``, ``data=webdataset``, your own Dataset;
    trainkit.data.transforms): decoded to ``channels`` (3: RGB, 1: grayscale); training:
    random-resized crop to ``image_size`` (area fraction in ``scale``, aspect ratio in
    ``ratio``) and ``random_flip``; evaluation: resize to ``image_size / crop_pct``, centre crop.
    ``mean``/``std`` on the 0-1 scale; null: ImageNet's."""

    image_size: int = 224
    channels: int = 3
    scale: list[float] = field(default_factory=lambda: [0.08, 1.0])
    ratio: list[float] = field(default_factory=lambda: [3 / 4, 4 / 3])
    crop_pct: float = 0.875
    random_flip: bool = False
    mean: list[float] | None = None
    std: list[float] | None = None
    # Lists of `_target_` nodes (torchvision.transforms.v2 or any callable) applied to the uint8
    # [C, H, W] image; they replace the default transforms when set.
    train_transforms: list[Any] | None = None
    eval_transforms: list[Any] | None = None
    val_fraction: float = 0.1  # no val/ folder: this fraction of each class validates (seeded)
    skip_corrupt: bool = False  # an unreadable file: skip it (counted), instead of stopping
    # JPEGs of data=image_folder: "cpu" decodes and crops in the loader's workers; "gpu" (CUDA
    # only) has the workers read the bytes and draw the crops, and decodes each batch on the GPU
    # in one nvJPEG call (trainkit.data.device.gpu_decode); other formats decoded in the workers.
    decode: str = "cpu"
    # dataset._target_ returning a Hugging Face datasets.Dataset: its image and label columns
    image_column: str = "image"
    label_column: str = "label"
    # Training only, after the crop and flip (torchvision.transforms.v2): randaugment or
    # trivialaugment (null: none); random erasing with this probability (0: off).
    auto_augment: str | None = None
    random_erasing: float = 0.0

    def _check(self) -> None:
        _check_int("data.image_size", self.image_size, minimum=1)
        if self.channels not in (1, 3):
            raise ConfigError(f"data.channels={self.channels!r}: use 3 (RGB) or 1 (grayscale)")
        for key, pair in (("scale", self.scale), ("ratio", self.ratio)):
            pair = [float(v) for v in pair]
            if len(pair) != 2 or not 0.0 < pair[0] <= pair[1]:
                raise ConfigError(f"data.{key} must be [low, high] with 0 < low <= high, got "
                                  f"{list(pair)}")
            setattr(self, key, pair)
        if not 0 < self.crop_pct <= 1.5:
            raise ConfigError(f"data.crop_pct must be in (0, 1.5], got {self.crop_pct}")
        for key in ("mean", "std"):
            values = getattr(self, key)
            if values is not None and len(values) != self.channels:
                raise ConfigError(f"data.{key} has {len(values)} values but data.channels="
                                  f"{self.channels}: give one per channel")
        if self.std is not None and not all(v > 0 for v in self.std):
            raise ConfigError(f"data.std must be > 0, got {list(self.std)}")
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        _check_bool("data.skip_corrupt", self.skip_corrupt)
        if self.decode not in DECODERS:
            raise ConfigError(f"data.decode={self.decode!r}: use 'cpu' or 'gpu' (CUDA)")
        if self.auto_augment is not None:
            _check_choice("data.auto_augment", self.auto_augment, AUTO_AUGMENTS)
        if (isinstance(self.random_erasing, bool)
                or not isinstance(self.random_erasing, (int, float))
                or not 0 <= self.random_erasing <= 1):
            raise ConfigError(f"data.random_erasing is a probability in [0, 1], got "
                              f"{self.random_erasing!r}")
        if self.decode == "gpu" and (self.auto_augment or self.random_erasing):
            raise ConfigError("data.auto_augment and data.random_erasing run in the loader's "
                              "workers: use them with data.decode=cpu")


@dataclass
class MixFields:
    """Image classification's batch mixing in training (trainkit.data.mixing): MixUp and
    CutMix with these Beta alphas (0: off; both set: one of them per batch), on the device."""

    mixup: float = 0.0
    cutmix: float = 0.0

    def _check(self) -> None:
        for key in ("mixup", "cutmix"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"data.{key} is a Beta alpha >= 0 (0: off), got {value!r}")


@dataclass
class RepeatFields:
    """Repeated augmentation in training (timm's ``RepeatAugSampler``, DeiT): each sample of an
    epoch ``repeated_aug`` times, the copies spread over the ranks and each augmented on its
    own; an epoch keeps its length, so it sees ``1 / repeated_aug`` of the distinct samples
    (1: off; timm and DeiT use 3)."""

    repeated_aug: int = 1

    def _check(self) -> None:
        _check_int("data.repeated_aug", self.repeated_aug, minimum=1)


@dataclass
class TokenFields:
    """``data=tokens`` (trainkit.data.sources.tokens): tokens of context per window, and the
    token files' dtype (null: meta.json's, else uint16)."""

    seq_len: int = 256
    token_dtype: str | None = None

    def _check(self) -> None:
        _check_int("data.seq_len", self.seq_len, minimum=1)
        if self.token_dtype not in (None, "uint16", "uint32"):
            raise ConfigError(f"data.token_dtype={self.token_dtype!r}: use uint16, uint32 or "
                              "null (from meta.json)")


@dataclass
class TextFields:
    """``data=hf_text`` (trainkit.data.sources.hf_text): the tokenizer's folder (the model's),
    the column of the texts, of their classes (absent: causal language modelling), tokens per
    text."""

    tokenizer: str | None = None
    text_column: str = "text"
    label_column: str = "label"
    seq_len: int = 256
    # causal LM: documents packed into seq_len windows, attention kept inside each
    # (trainkit.data.sources.packing); false: each text padded to its batch's longest
    pack: bool = False

    def _check(self) -> None:
        _check_int("data.seq_len", self.seq_len, minimum=1)
        if not isinstance(self.pack, bool):
            raise ConfigError(f"data.pack must be true or false, got {self.pack!r}")


MIX_KEYS = ("root", "weight", "name", "source")  # what a data.mix entry may say


@dataclass
class MixtureFields:
    """``data.mix`` (``data=tokens``, ``data=hf_text``; trainkit.data.sources.mixture): a list
    of ``{root, weight}`` (and optionally ``name``, ``source``): each training sample drawn
    from one of these corpora by weight, each corpus evaluated apart (``val/loss/<name>``).
    null: ``data.root`` alone."""

    mix: list[Any] | None = None

    def _check(self) -> None:
        if self.mix is None:
            return
        if not isinstance(self.mix, (list, tuple)) or not self.mix:
            raise ConfigError(f"data.mix must be a non-empty list of {{root, weight}} entries, "
                              f"got {self.mix!r}")
        for i, entry in enumerate(self.mix):
            if not isinstance(entry, Mapping):
                raise ConfigError(f"data.mix[{i}]={entry!r} is not a {{root, weight}} entry")
            unknown = [key for key in entry if key not in MIX_KEYS]
            if unknown:
                raise ConfigError(f"data.mix[{i}].{unknown[0]} is not read: an entry takes "
                                  f"{', '.join(MIX_KEYS)}")
            if not isinstance(entry.get("root"), str) or not entry["root"]:
                raise ConfigError(f"data.mix[{i}] needs a root (the corpus's folder or URL)")
            weight = entry.get("weight")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (
                    0 < weight < float("inf")):
                raise ConfigError(f"data.mix[{i}].weight must be a number > 0, got {weight!r}")


@dataclass
class ShardFields:
    """``data=webdataset`` (trainkit.data.sources.webdataset): training and validation shards, a
    brace pattern or a list of paths/URLs (null: <root>/shards.json's); training samples per
    rank in an epoch (null: shards.json's total / ranks); the shuffle buffer's samples per
    worker."""

    shards: Any = None
    val_shards: Any = None
    epoch_samples: int | None = None
    shuffle_buffer: int = 1000
    # shards at an fsspec URL (s3://...; trainkit.data.remote): their local copies are kept
    # within this many GiB, least recently used removed first; 0: no copies
    cache_gb: float = 10.0

    def _check(self) -> None:
        if isinstance(self.cache_gb, bool) or not self.cache_gb >= 0:
            raise ConfigError(f"data.cache_gb must be >= 0, got {self.cache_gb!r}")
        if self.epoch_samples is not None:
            _check_int("data.epoch_samples", self.epoch_samples, minimum=1)
        _check_int("data.shuffle_buffer", self.shuffle_buffer, minimum=1)


# Each source's typed config: the shared fields and its own (trainkit.data.sources.SOURCES);
# the shared part is the last base, so that its fields come first.
@dataclass
class TensorDataConfig(RepeatFields, MixFields, TensorFields, SharedDataConfig):
    """``data=mnist`` and ``data=cifar10``."""


@dataclass
class ImageFolderConfig(RepeatFields, MixFields, ImageFields, SharedDataConfig):
    """``data=image_folder``."""


@dataclass
class DatasetConfig(RepeatFields, MixFields, ImageFields, TensorFields, SharedDataConfig):
    """Your own dataset (``dataset._target_``): image samples, or a ``TensorData``."""


@dataclass
class WebDatasetConfig(MixFields, ShardFields, ImageFields, SharedDataConfig):
    """``data=webdataset``."""


@dataclass
class TokensConfig(MixtureFields, TokenFields, SharedDataConfig):
    """``data=tokens``."""


@dataclass
class HFTextConfig(MixtureFields, TextFields, SharedDataConfig):
    """``data=hf_text``."""


@dataclass
class DataConfig(RepeatFields, MixtureFields, MixFields, ShardFields, TextFields, TokenFields,
                 ImageFields, TensorFields, SharedDataConfig):
    """The ``data`` node users type (every source's keys, ``data.name`` picks the source);
    :func:`trainkit.data.load_data` hands the source its own typed config of these."""


@dataclass
class CheckpointConfig:
    """When to save and what to resume from (``auto``: newest valid in the run dir; null: never).

    ``init_from``: a checkpoint file whose model weights (and EMA weights, when this run keeps an
    EMA) a new run starts from -- fine-tuning -- with a fresh optimizer, LR schedule and counters.
    Only when there is nothing to resume: a preempted fine-tuning run resumes itself.
    """

    every_n_steps: int = 0  # 0: only at the end of the run (and when preempted)
    every_n_minutes: float = 0.0  # also save when this much time passed since the last save
    keep_last: int = 3
    resume: str | None = "auto"
    init_from: str | None = None  # a checkpoint whose weights a new run starts from
    save_last: bool = True
    monitor: str | None = None  # e.g. "val/acc": keep checkpoints/best.pt by this metric
    mode: str = "max"  # whether a larger or smaller `monitor` is better
    async_save: bool = False  # write on a background thread; the loop waits only for a copy
    # where checkpoints go: null = <run dir>/checkpoints; or a path, or any fsspec URL
    # (s3://bucket/run, gs://..., az://...; docs/storage.md): credentials from the environment
    dir: str | None = None
    # a LoRA run: `model` holds only the trainable tensors (adapters, a new head), the frozen
    # base rebuilt from the model's config (trainkit.checkpoint.adapters)
    adapters_only: bool = False

    def __post_init__(self) -> None:
        _check_int("checkpoint.every_n_steps", self.every_n_steps, minimum=0)
        if isinstance(self.every_n_minutes, bool) or not self.every_n_minutes >= 0:
            raise ConfigError(
                f"checkpoint.every_n_minutes must be >= 0, got {self.every_n_minutes!r}"
            )
        _check_int("checkpoint.keep_last", self.keep_last, minimum=1)
        if not isinstance(self.async_save, bool):
            raise ConfigError(f"checkpoint.async_save must be true or false, got "
                              f"{self.async_save!r}")
        _check_choice("checkpoint.mode", self.mode, MONITOR_MODES)
        _check_bool("checkpoint.adapters_only", self.adapters_only)


@dataclass
class TrainConfig:
    """Everything one run of ``python -m trainkit.train`` needs.

    ``model``, ``optim``, ``sched``, ``loss``, ``dataset`` and each of ``sinks`` are ``_target_``
    nodes: the edges where users plug in their own classes; ``callbacks`` and ``metrics`` map
    names to such nodes.
    """

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    model: Any = None
    optim: Any = None
    sched: Any = None
    loss: Any = None  # null: plain cross-entropy
    # forward(model, batch) -> (outputs, targets[, {name: scalar}]); null: model(inputs), labels
    forward: Any = None
    metrics: Any = None  # {name: _target_ node}: evaluation metrics, reported as val/<name>
    dataset: Any = None  # null: the built-in data.name; else your reader(root, train) -> TensorData
    # more metrics sinks beside TensorBoard and metrics.jsonl, name -> `_target_` node, e.g.
    # +sinks.mlflow._target_=trainkit.MLflowSink (docs/trackers.md); a null node is left out
    sinks: dict[str, Any] = field(default_factory=dict)
    callbacks: dict[str, Any] = field(default_factory=dict)  # name -> a `_target_` node
    # `trainkit sweep`'s search space, {params: {key: {low, high, log} or {choices}}}; read by
    # that command only (configs/sweep/, docs/sweeps.md)
    sweep: Any = None


def _check_int(key: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {value}")


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    """One of ``choices``, else one line naming them ("use 'a' or 'b'" when there are two)."""
    if value in choices:
        return
    if len(choices) == 2:
        raise ConfigError(f"{key}={value!r}: use {choices[0]!r} or {choices[1]!r}")
    raise ConfigError(f"{key}={value!r} is not one of {', '.join(choices)}")


def _checkpointing(value: Any) -> list[str]:
    """``trainer.activation_checkpointing`` as a list: ``[]`` (off), ``["selective"]`` (the
    repeated blocks, selectively), or selectors with at most one policy word among them."""
    if value is None or value is False or value in ("off", "none"):
        return []
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) and v for v in value):
        policies = [v for v in value if v in CHECKPOINT_POLICIES]
        if len(policies) <= 1:
            return list(value)
    raise ConfigError(f"trainer.activation_checkpointing={value!r}: use full or selective (the "
                      "model's repeated blocks), a list of module classes or paths (e.g. [Block] "
                      "or [selective, Block]), or [] (off)")


def _compile_mode(value: Any) -> bool | str:
    """``trainer.compile``: false, true (the whole model) or ``regional``."""
    value = {"true": True, "false": False}.get(value, value) if isinstance(value, str) else value
    if any(value is mode or (isinstance(mode, str) and value == mode) for mode in COMPILE_MODES):
        return value
    raise ConfigError(f"trainer.compile={value!r}: use false, true (the whole model) or regional "
                      "(each repeated block, compiled once)")


def _check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a.b": leaf}`` for a nested config ``{"a": {"b": leaf}}``."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
