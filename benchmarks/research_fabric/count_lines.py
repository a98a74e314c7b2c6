"""Lines of code of each examples/research/ program beside its Lightning Fabric version here:
``python -m benchmarks.research_fabric.count_lines`` prints the table docs/research.md shows.

A line of code holds a token other than a comment or a docstring (blank lines, comments and
docstrings are not counted); the shared data module (examples/research/digits.py) counts for
neither side.
"""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent.parent / "examples" / "research"
PROGRAMS = ("distill", "simclr", "gan", "multitask")


def code_lines(path: Path) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    lines: set[int] = set()
    previous, depth = tokenize.NEWLINE, 0  # a docstring is a string that starts a statement
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        kind = token.type
        depth += token.string in "([{" and kind == tokenize.OP
        depth -= token.string in ")]}" and kind == tokenize.OP
        docstring = kind == tokenize.STRING and depth == 0 and previous in (
            tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
        if kind not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                        tokenize.DEDENT, tokenize.ENDMARKER) and not docstring:
            lines.update(range(token.start[0], token.end[0] + 1))
        if kind not in (tokenize.COMMENT, tokenize.NL):
            previous = kind
    return len(lines)


def table() -> str:
    rows = ["| program | trainkit | Lightning Fabric |", "| --- | ---: | ---: |"]
    for name in PROGRAMS:
        rows.append(f"| {name} | {code_lines(EXAMPLES / f'{name}.py')} | "
                    f"{code_lines(HERE / f'{name}.py')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
