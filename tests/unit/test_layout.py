"""The layout shows the layers (docs/architecture.md): no folder imports one above it."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "trainkit"
# Bottom to top. The schema (config.py) sits with core; the few top-level modules that keep a
# documented path (``python -m trainkit.train``, ``trainkit.launch``, ...) hand on to any layer.
LAYERS = ["core", "distributed", "data", "models", "observe", "checkpoint", "loop", "entry"]
SCHEMA = {"config"}
PASS_THROUGH = {"__init__", "__main__", "train", "verify_resume", "probe", "launch", "env"}


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
    """A module's rank in :data:`LAYERS` (the schema ranks with core); None above them all: the
    pass-throughs and the package itself (``from trainkit import x`` loads every layer)."""
    part = module.split(".")[1]
    if part in LAYERS:
        return LAYERS.index(part)
    return 0 if part in SCHEMA else None


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


def test_the_top_level_holds_folders_the_schema_and_documented_pass_throughs() -> None:
    modules = {path.stem for path in PACKAGE.glob("*.py")}
    assert modules <= SCHEMA | PASS_THROUGH, sorted(modules - SCHEMA - PASS_THROUGH)
    for name in modules - SCHEMA - {"__init__", "__main__"}:
        code = [line for line in (PACKAGE / f"{name}.py").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith(("#", '"', "'"))]
        assert len(code) <= 8, f"trainkit/{name}.py is more than a module that hands on"


def test_each_new_folder_says_its_concern_in_one_line_and_is_packaged() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    for layer in LAYERS:
        init = PACKAGE / layer / "__init__.py"
        assert f'"trainkit.{layer}"' in pyproject  # in setuptools' packages: the wheel has it
        if layer not in ("data", "models"):  # their exports are API (`from trainkit.data ...`)
            lines = init.read_text().splitlines()
            assert len(lines) == 1 and lines[0].startswith('"""'), init


def test_the_top_level_holds_only_the_documented_module_paths() -> None:
    """Issue 59, item 3: each command has one home (entry/, or its layer's module); the only
    top-level modules are the package, its schema and the ``python -m`` paths the interface
    contract names (trainkit.train, .launch, .verify_resume, .env, .probe; trainkit.checkpoint
    and trainkit.data are packages)."""
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert top == PASS_THROUGH | SCHEMA, sorted(top ^ (PASS_THROUGH | SCHEMA))
    for name in PASS_THROUGH - {"__init__"}:  # a few lines that hand on, nothing of their own
        assert len((PACKAGE / f"{name}.py").read_text().splitlines()) <= 12, name
