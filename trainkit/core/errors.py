"""The one exception type users see as a short error line instead of a traceback."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable

# The last line a failed command prints says what is wrong and how to fix it, in at most this
# many characters (a terminal line or two); longer evidence goes on detail lines before it.
LINE_LIMIT = 200
_DETAIL_CHARS = 300  # per detail line: enough for a path and an exception's first words
_DETAIL_LINES = 12


class TrainkitError(Exception):
    """A problem with the user's input or environment, stated with how to fix it.

    Entry points print ``str(error)`` as the last line (<= :data:`LINE_LIMIT` characters with
    its ``trainkit:`` prefix) and exit non-zero; ``details`` (file lists, the exception chain,
    key lists) are printed on lines before it. Library users can catch it.

    Example:
        >>> raise TrainkitError("MNIST not found: run `python -m trainkit.data download mnist`",
        ...                     details=["/data/MNIST/raw lacks train-images-idx3-ubyte"])
        ... # doctest: +SKIP
    """

    def __init__(self, message: str, *, details: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.details = [line for text in details for line in str(text).splitlines() if line]


class ConfigError(TrainkitError, ValueError):
    """A config value of the wrong type or out of range."""


def one_line(err: BaseException | str, limit: int = 300) -> str:
    """``err``'s message with its whitespace folded, for embedding in a one-line error."""
    return " ".join(str(err).split())[:limit] or type(err).__name__


def error_lines(message: str, details: Iterable[str] = (), *, prefix: str = "trainkit: "
                ) -> list[str]:
    """What a failed command prints: indented detail lines, then ``prefix + message``.

    The last line is kept to :data:`LINE_LIMIT` characters, cut between words only: a longer
    message is printed whole once, as the detail just above (not again where a detail already
    holds it), and the last line keeps its start (what is wrong) and its end (how to fix),
    whole words each. Detail lines are cut to a readable length; a long list says how many
    lines it left out.
    """
    message = " ".join(message.split())
    lines = [_cut(" ".join(d.split()), _DETAIL_CHARS) for d in details if d.strip()]
    if len(lines) > _DETAIL_LINES:
        lines[_DETAIL_LINES - 1:] = [f"... and {len(lines) - _DETAIL_LINES + 1} more lines"]
    last = prefix + message
    if len(last) > LINE_LIMIT:
        if not any(message in line for line in lines):
            lines.append(_cut(message, 4 * _DETAIL_CHARS))
        head, _, tail = _split_words(message, LINE_LIMIT - len(prefix) - len(" ... "))
        last = prefix + (f"{head} ... {tail}" if head else f"... {tail}")
    return [f"  {line}" for line in lines] + [last]


def _split_words(message: str, room: int) -> tuple[str, str, str]:
    """``message`` as (start, middle, end), cut between words, start and end together at most
    ``room`` characters: the end (the fix) gets up to 2/3 of it, the start what is left (a first
    word longer than that, a key=path, is the one word cut: its start is what names it)."""
    words = message.split(" ")
    end = len(words)
    while end > 1 and len(" ".join(words[end - 1:])) <= room * 2 // 3:
        end -= 1
    tail = " ".join(words[end:])
    start = 0
    while start < end and len(" ".join(words[:start + 1])) + len(tail) <= room:
        start += 1
    if start == 0 and end > 0:  # a first word too long for the line (a key=path): its start
        return words[0][:max(0, room - len(tail))], " ".join(words[:end]), tail
    return " ".join(words[:start]), " ".join(words[start:end]), tail


def print_error(message: str, details: Iterable[str] = (), *, prefix: str = "trainkit: "
                ) -> list[str]:
    """Print :func:`error_lines` to stderr; return them (for a log file)."""
    lines = error_lines(message, details, prefix=prefix)
    print("\n".join(lines), file=sys.stderr, flush=True)
    return lines


def command_name(module: str) -> str:
    """How the running command names itself in its usage line: ``trainkit <command>`` when the
    console command started it (which puts that in ``sys.argv[0]``), else ``python -m <module>``.
    """
    return sys.argv[0] if sys.argv[0].startswith("trainkit ") else f"python -m {module}"


def help_text(doc: str | None) -> str:
    """A module docstring as a command's ``--help`` shows it: plain text, without reST's double
    backticks and roles (``:mod:`trainkit.x``` -> ``trainkit.x``)."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc or "")
    return text.replace("``", "")


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit - 30]}... ({len(text)} characters)"


def chain_lines(err: BaseException, limit: int = 6) -> list[str]:
    """``Type: message`` for ``err`` and the exceptions that caused it, outermost first."""
    lines: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen and len(lines) < limit:
        seen.add(id(current))
        lines.append(f"{type(current).__name__}: {one_line(current, 4 * _DETAIL_CHARS)}")
        current = current.__cause__ or current.__context__
    return lines
