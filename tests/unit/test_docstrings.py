"""Docstrings say what and why (issue 48): no benchmark figure, no module essay over 15 lines.

A figure belongs to benchmarks/README.md beside the command that measures it. The commands whose
module docstring is their ``--help`` text may be longer.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from tests.conftest import REPO

PACKAGE = REPO / "trainkit"
HELP_TEXTS = {"trainkit/entry/export.py", "trainkit/entry/predict.py"}  # printed by --help
# "~0.3 ms", "4x faster", "25 us", "on this project's 2-core machine"
FIGURE = re.compile(r"~\s?\d|\d\s?x (faster|slower|quicker)|\d\s?(ms|us|µs)\b|this project's|"
                    r"\d-core\b")
MODULE_LINES = 15


def _docstrings() -> Iterator[tuple[str, ast.AST, str]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc is not None:
                    yield f"{path.relative_to(REPO)}:{getattr(node, 'name', '')}", node, doc


def _figures(doc: str) -> list[str]:
    return [line.strip() for line in doc.splitlines() if FIGURE.search(line)]


def test_no_docstring_carries_a_benchmark_figure() -> None:
    found = {where: lines for where, _, doc in _docstrings() if (lines := _figures(doc))}
    assert found == {}


def test_no_module_docstring_is_over_15_lines() -> None:
    long = {where: len(doc.splitlines()) for where, node, doc in _docstrings()
            if isinstance(node, ast.Module) and len(doc.splitlines()) > MODULE_LINES
            and where.split(":")[0] not in HELP_TEXTS}
    assert long == {}


def test_the_figure_pattern_finds_the_figures_issue_48_named() -> None:
    for line in ("joined per fit would cost ~0.3 ms", "copies 4x faster on the CPU",
                 "~5 ms per step on this project's 2-core machine", "~100x slower", "25 us"):
        assert _figures(line), line
    assert not _figures(":class:`~trainkit.Trainer` at step 10, 2 ranks, cuda:1")
