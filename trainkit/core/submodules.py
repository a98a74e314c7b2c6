"""Which submodules of a model a list of selectors names, and which are its repeated blocks.

The rules ``trainer.activation_checkpointing``, ``trainer.fsdp_blocks`` and
``trainer.compile=regional`` share: the loop and the distributed layer both select blocks with
them.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from torch import nn

from trainkit.core.errors import LINE_LIMIT, ConfigError


def match_modules(model: nn.Module, selectors: Sequence[str], key: str, *,
                  nested: bool = False) -> list[str]:
    """Paths of the submodules whose class name or qualified name is in ``selectors``.

    The matching rule of ``trainer.activation_checkpointing``, shared by ``trainer.fsdp_blocks``:
    a selector is a class name (``"Block"``) or a path from ``model.named_modules()``
    (``"layers.3"``). Without ``nested``, modules inside one already matched are left out (its
    selectors still count as matched). Paths come in ``named_modules()`` order (parents first).

    Raises:
        ConfigError: a selector matched nothing; the line, headed by ``key``, lists the model's
            module classes and top-level paths.
    """
    wanted = set(selectors)
    matched: set[str] = set()
    found: list[str] = []
    for name, module in model.named_modules():
        if not name:
            continue
        keys = {type(module).__name__, name} & wanted
        if not keys:
            continue
        matched |= keys
        if nested or not any(name.startswith(done + ".") for done in found):
            found.append(name)
    unknown = wanted - matched
    if unknown:
        raise ConfigError(_no_match(model, sorted(unknown), key))
    return found


def repeated_blocks(model: nn.Module) -> list[str]:
    """Paths of the model's repeated blocks: a transformer's layers, a ResNet's stages.

    The rule: among module classes with parameters that occur at least twice (the outermost
    instances only), the one whose instances are largest on average (parameters per instance);
    its instances are the blocks. A model with no repeated class has none (``[]``).
    """
    sizes: dict[str, list[int]] = collections.defaultdict(list)
    paths: dict[str, list[str]] = collections.defaultdict(list)
    for name, module in model.named_modules():
        cls = type(module).__name__
        if not name or any(name.startswith(p + ".") for p in paths[cls]):
            continue  # the root, or inside an instance of its own class
        count = sum(p.numel() for p in module.parameters())
        if count:
            sizes[cls].append(count)
            paths[cls].append(name)
    repeated = [cls for cls, n in sizes.items() if len(n) >= 2]
    if not repeated:
        return []
    best = max(repeated, key=lambda cls: sum(sizes[cls]) / len(sizes[cls]))  # first on ties
    return paths[best]


def _no_match(model: nn.Module, unknown: list[str], key: str) -> str:
    """One line naming what the model offers to select instead, short enough that the printed
    ``trainkit: ...`` line keeps it whole (a longer one would be cut in its middle)."""
    classes = list(dict.fromkeys(type(m).__name__ for n, m in model.named_modules() if n))
    paths = [name for name, _ in model.named_children()]
    head = f"{key}: {unknown} match nothing in {type(model).__name__}"
    tail = f"; its paths: {', '.join(paths)}; classes: {', '.join(classes)}"
    budget = LINE_LIMIT - len("trainkit: ")
    if len(head + tail) > budget:
        tail = tail[: max(0, budget - 4 - len(head))] + " ..."
    return head + tail
