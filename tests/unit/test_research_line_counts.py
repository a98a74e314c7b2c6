"""docs/research.md's table of lines of code (examples/research/ against the Lightning Fabric
versions in benchmarks/research_fabric/) is what the counting script prints today."""

from __future__ import annotations

from benchmarks.research_fabric.count_lines import code_lines, table
from tests.conftest import REPO


def test_the_docs_table_matches_the_programs() -> None:
    assert table() in (REPO / "docs" / "research.md").read_text()


def test_comments_blank_lines_and_docstrings_are_not_code(tmp_path) -> None:
    source = tmp_path / "x.py"
    source.write_text('"""doc\nstring"""\n\n# comment\ndef f():\n    """doc"""\n'
                      '    return g("a",\n             "b")  # call\n')
    assert code_lines(source) == 3
