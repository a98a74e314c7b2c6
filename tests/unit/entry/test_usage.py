"""The after-training commands' usage: without arguments on stderr with exit status 2, asked for
with -h/--help on stdout with 0, in both commands alike."""

from __future__ import annotations

import pytest

from trainkit.entry import evaluate, predict


@pytest.mark.parametrize("command", [evaluate, predict], ids=["evaluate", "predict"])
def test_no_arguments_is_the_usage_on_stderr_and_help_is_it_on_stdout(
        command, capsys: pytest.CaptureFixture[str]) -> None:
    assert command.main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: ") and command.USAGE in err
    for flag in ("-h", "--help"):
        assert command.main([flag]) == 0
        out, err = capsys.readouterr()
        assert err == "" and out.startswith("usage: ") and command.USAGE in out
