"""Which submodules of a model a list of selectors names.

The rule ``trainer.activation_checkpointing`` and ``trainer.fsdp_blocks`` share: the loop and
the distributed layer both select blocks with it.
"""

from __future__ import annotations

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
