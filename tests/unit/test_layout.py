"""The layout shows the layers (docs/architecture.md): no folder imports one above it."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "trainkit"
# Bottom to top; the top-level modules sit below them all, the entry points above.
LAYERS = ["distributed", "data", "models", "observe", "checkpoint", "loop", "entry"]
ENTRY_POINTS = {"__init__", "__main__", "train", "verify_resume", "probe", "launch", "env",
                "evaluate"}


def _imported(path: Path) -> set[str]:
    """The trainkit modules ``path`` imports (``from trainkit import x`` names ``trainkit.x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "trainkit":
                found |= {f"trainkit.{alias.name}" for alias in node.names}
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name.startswith("trainkit.")}


def _layer(module: str) -> int | None:
    """A module's rank in :data:`LAYERS` (-1: a top-level module); None for an entry point."""
    part = module.split(".")[1]
    if part in LAYERS:
        return LAYERS.index(part)
    return None if part in ENTRY_POINTS else -1


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(REPO).with_suffix("")
        own = _layer(".".join(relative.parts))
        if own is None:
            continue
        upward += [f"{relative}: {name}" for name in sorted(_imported(path))
                   if (other := _layer(name)) is None or other > own]
    assert upward == []


def test_each_new_folder_says_its_concern_in_one_line_and_is_packaged() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    for layer in LAYERS:
        init = PACKAGE / layer / "__init__.py"
        assert f'"trainkit.{layer}"' in pyproject  # in setuptools' packages: the wheel has it
        if layer not in ("data", "models"):  # their exports are API (`from trainkit.data ...`)
            lines = init.read_text().splitlines()
            assert len(lines) == 1 and lines[0].startswith('"""'), init
