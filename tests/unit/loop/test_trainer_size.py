"""The Trainer stays a loop whose parts decide (issue 39): a short module of short functions."""

from __future__ import annotations

import ast
import io
import tokenize

from tests.conftest import REPO

TRAINER = REPO / "trainkit" / "loop" / "trainer.py"
MAX_LINES, MAX_FUNCTION = 300, 40


def _code_lines(source: str) -> tuple[ast.Module, set[int]]:
    """The module's tree and its lines of code: not blank, comment or docstring."""
    tree = ast.parse(source)
    docstrings: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                docstrings |= set(range(first.lineno, first.end_lineno + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER}
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            lines |= set(range(token.start[0], token.end[0] + 1)) - docstrings
    return tree, lines


def test_trainer_is_at_most_300_code_lines_with_no_function_over_40() -> None:
    tree, lines = _code_lines(TRAINER.read_text())
    assert len(lines) <= MAX_LINES
    long = {node.name: n for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if (n := len({line for line in lines
                          if node.lineno <= line <= node.end_lineno})) > MAX_FUNCTION}
    assert long == {}


def test_the_count_leaves_out_docstrings_and_comments() -> None:
    source = 'def f():\n    """Doc\n    string."""\n    # a comment\n\n    return 1\n'
    assert _code_lines(source)[1] == {1, 6}


def _self_calls(function: ast.FunctionDef) -> set[str]:
    """The names of the ``self.<name>(...)`` methods ``function`` calls."""
    return {node.func.attr for node in ast.walk(function)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"}


def _depth(methods: dict[str, ast.FunctionDef], name: str, seen: tuple[str, ...] = ()) -> int:
    """How many of the Trainer's own methods deep a call of ``name`` goes (itself counted)."""
    callees = [c for c in _self_calls(methods[name]) if c in methods and c not in seen]
    return 1 + max((_depth(methods, c, (*seen, name)) for c in callees), default=0)


def test_the_loop_is_at_most_four_calls_deep_from_fit() -> None:
    """Issue 48: fit -> _run -> _epoch -> _step, not fit -> _fit -> _run -> _train -> ..."""
    tree = ast.parse(TRAINER.read_text())
    trainer = next(node for node in tree.body
                   if isinstance(node, ast.ClassDef) and node.name == "Trainer")
    methods = {node.name: node for node in trainer.body if isinstance(node, ast.FunctionDef)}
    assert _depth(methods, "fit") <= 4
    assert _depth(methods, "_epoch") >= 2  # the count follows calls: _epoch calls _step


def test_the_depth_counts_each_level_of_self_calls() -> None:
    tree = ast.parse("class T:\n def a(self): self.b()\n def b(self): self.c(); self.a()\n"
                     " def c(self): return 1\n")
    methods = {node.name: node for node in tree.body[0].body}
    assert _depth(methods, "a") == 3 and _depth(methods, "c") == 1
