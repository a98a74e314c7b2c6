"""The checkpoint package's seams, by its imports and calls (issue 59 item 2):

- one module tells a local path from a URL (``trainkit/core/location.py``): ``is_url`` is called
  nowhere else in trainkit;
- the after-training readers (select, load, export, text export) live apart from the writers:
  no writer imports a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "trainkit"
LOCATION = PACKAGE / "core" / "location.py"
READERS = {"select", "load", "export", "text_export"}
WRITERS = {"checkpointer", "storages", "location", "layout", "files", "remote", "sharded",
           "remote_sharded", "async_writer", "reshard", "adapters", "contents"}


def _calls(path: Path, name: str) -> list[int]:
    """The lines of ``path`` that call ``name`` (as ``name(...)`` or ``module.name(...)``)."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call)
            and (getattr(node.func, "id", None) == name
                 or getattr(node.func, "attr", None) == name)]


def _checkpoint_imports(path: Path) -> set[str]:
    """The ``trainkit.checkpoint`` modules ``path`` imports, by basename (at any depth)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "trainkit.checkpoint":
                found |= {alias.name for alias in node.names}
            elif node.module.startswith("trainkit.checkpoint."):
                found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[2] for alias in node.names
                      if alias.name.startswith("trainkit.checkpoint.")}
    return found


def is_url_calls() -> dict[str, list[int]]:
    """``{module: lines}`` of the ``is_url`` calls outside the location module."""
    found = {str(path.relative_to(REPO)): lines for path in sorted(PACKAGE.rglob("*.py"))
             if path != LOCATION and (lines := _calls(path, "is_url"))}
    return found


def writers_importing_readers() -> list[str]:
    """``writer -> reader`` for each import of a reader by a writer module."""
    return [f"{writer} -> {reader}" for writer in sorted(WRITERS)
            for reader in sorted(_checkpoint_imports(PACKAGE / "checkpoint" / f"{writer}.py")
                                 & READERS)]


def test_only_the_location_module_tells_a_path_from_a_url() -> None:
    assert _calls(LOCATION, "is_url")  # it is there, and the measure sees calls
    assert is_url_calls() == {}


def test_no_writer_imports_an_after_training_reader() -> None:
    present = {path.stem for path in (PACKAGE / "checkpoint").glob("*.py")}
    assert present >= READERS | WRITERS  # every module named here exists
    assert writers_importing_readers() == []
