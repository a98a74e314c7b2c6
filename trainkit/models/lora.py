"""LoRA adapters through PEFT (``model.lora={r, alpha, dropout, target_modules}``).

:func:`apply_lora` wraps a model in PEFT's ``PeftModel``: low-rank adapters beside the
``nn.Linear`` / ``nn.Conv2d`` layers named (and the others PEFT adapts: ``nn.Embedding``,
transformers' ``Conv1D``), every other weight frozen -- PEFT's own freezing. PEFT's task type
(:func:`task_type`: ``SEQ_CLS``, ``CAUSAL_LM``) is what transformers says the model is; a
sequence classifier also trains its new head (PEFT's ``modules_to_save`` for the task); name
others with ``modules_to_save``. The wrapped model's ``state_dict`` keys are PEFT's
(``base_model.model.<name>...lora_A.default.weight``): the checkpoints of a LoRA run load into
the same wrapping. :func:`merged` folds the adapters into the weights (``merge_and_unload``):
the plain model, as ``trainkit export`` writes it.
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn

from trainkit.core.errors import ConfigError, TrainkitError, one_line

KEYS = ("r", "alpha", "dropout", "target_modules", "modules_to_save")
# PEFT's task type of a transformers model, by the auto class that builds models of its kind
# (GPT2LMHeadModel is a causal LM though its name does not say so); a classifier's head is then
# trained too
TASK_TYPES = (("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING", "SEQ_CLS"),
              ("MODEL_FOR_CAUSAL_LM_MAPPING", "CAUSAL_LM"))


def apply_lora(model: nn.Module, lora: Mapping[str, Any]) -> nn.Module:
    """``model`` with LoRA adapters on the modules ``lora["target_modules"]`` names (PEFT's
    meaning: a module whose name is one of them or ends in ``.<one of them>``), the rest
    frozen.

    Raises:
        ConfigError: an unknown key, a bad rank, or a target that names no adaptable module.
    """
    unknown = sorted(set(lora) - set(KEYS))
    if unknown:
        raise ConfigError(f"model.lora.{unknown[0]} is not a LoRA setting: use "
                          f"{', '.join(KEYS)}")
    r, targets = lora.get("r", 8), list(lora.get("target_modules") or [])
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ConfigError(f"model.lora.r must be an integer >= 1, got {r!r}")
    if not targets:
        raise ConfigError("model.lora.target_modules is empty: name the layers to adapt, e.g. "
                          "[query, value]")
    missing = [t for t in targets if not any(name == t or name.endswith(f".{t}")
                                             for name, _ in model.named_modules())]
    if missing:  # PEFT itself stops only when none of them matches
        raise ConfigError(f"model.lora.target_modules: {', '.join(missing)} names no module of "
                          f"{type(model).__name__}; its layers end in {_layers(model)}")
    try:
        import peft
    except ImportError:
        raise TrainkitError("model.lora needs peft: pip install 'trainkit[finetune]'") from None
    config = peft.LoraConfig(
        r=r, lora_alpha=lora.get("alpha", 2 * r), lora_dropout=lora.get("dropout", 0.0),
        target_modules=targets, modules_to_save=lora.get("modules_to_save"),
        task_type=task_type(model), fan_in_fan_out=_transposed(model, targets))
    try:
        with warnings.catch_warnings():  # PEFT 0.21 reads a property transformers 5 deprecated
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated",
                                    FutureWarning)
            return peft.get_peft_model(model, config)
    except ValueError as err:  # PEFT's: no module matches, or one of a type it cannot adapt
        raise ConfigError(f"model.lora.target_modules={targets}: {one_line(err, 100)}; "
                          f"{type(model).__name__}'s layers end in {_layers(model)}") from None


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` is a PEFT model (adapters to merge or save)."""
    return hasattr(model, "merge_and_unload") and hasattr(model, "peft_config")


def merged(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with its adapters folded into the weights, PEFT's wrapping gone: the
    base model's own class and ``state_dict`` keys. A model without adapters as it is."""
    if not is_lora(model):
        return model
    return copy.deepcopy(model).merge_and_unload()


def save_adapters(model: nn.Module, folder: str) -> None:
    """The adapters alone in PEFT's format (``adapter_config.json`` and
    ``adapter_model.safetensors``), for ``PeftModel.from_pretrained(base, folder)``."""
    if not is_lora(model):
        raise TrainkitError("--adapters: this run trained no LoRA adapters (model.lora unset); "
                            "export the whole model without --adapters")
    model.save_pretrained(folder)


def task_type(model: nn.Module) -> str | None:
    """PEFT's task type for ``model`` (``SEQ_CLS``, ``CAUSAL_LM``), from what transformers says
    it is: the auto class whose mapping builds its class for its config, else a model that
    generates text without an encoder is a causal LM. None: not a transformers model."""
    config = getattr(model, "config", None)
    if config is None or "transformers" not in sys.modules:  # no transformers model without it
        return None
    import transformers

    if not isinstance(model, transformers.PreTrainedModel):
        return None
    for mapping, task in TASK_TYPES:
        auto = getattr(transformers, mapping)
        if type(config) in auto and issubclass(type(model), auto[type(config)]):
            return task
    if model.can_generate() and not getattr(config, "is_encoder_decoder", False):
        return "CAUSAL_LM"  # a class the mappings do not list (a subclass, the user's own)
    return None


def _transposed(model: nn.Module, targets: list[str]) -> bool:
    """Whether the layers adapted are transformers' ``Conv1D`` (GPT-2's), whose weights are
    stored transposed: PEFT's ``fan_in_fan_out``, which it would otherwise set with a warning."""
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    layers = [module for name, module in model.named_modules()
              if any(name == t or name.endswith(f".{t}") for t in targets)]
    return conv1d is not None and bool(layers) and all(isinstance(m, conv1d) for m in layers)


def _layers(model: nn.Module) -> str:
    """The last parts of the names of ``model``'s layers with weight matrices (a few), for a
    message: the names target_modules may take."""
    names = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                    if name and getattr(getattr(module, "weight", None), "ndim", 0) >= 2})
    return ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
