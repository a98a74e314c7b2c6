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
