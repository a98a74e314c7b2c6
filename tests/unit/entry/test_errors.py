"""The short last line of a failed command, the details before it, and the console command."""

from __future__ import annotations

import pytest

from trainkit.core.errors import LINE_LIMIT, TrainkitError, chain_lines, error_lines
from trainkit.entry import cli


def test_a_long_message_keeps_its_start_and_its_fix_within_the_limit() -> None:
    message = "files missing in /" + "very/long/" * 30 + "path: run `fetch --root DIR` to fix"
    *details, last = error_lines(message, ["first detail"])
    assert len(last) <= LINE_LIMIT
    # issue 61, fault 8: cut between words, so the long path is left out whole, not cut
    assert last == "trainkit: files missing in ... run `fetch --root DIR` to fix"
    assert details == ["  first detail", f"  {message}"]  # the whole message stays readable


def test_a_long_message_is_printed_whole_once_and_its_last_line_cut_between_words() -> None:
    """Issue 61, fault 8: the message whole once (not again where a detail holds it, as an
    error's chain does), and no word of it cut in the last line."""
    message = ("the storage cannot be reached (Could not connect to the endpoint URL: "
               f"\"http://127.0.0.1:9/bucket/{'run/' * 20}last.json\" after 3 attempts with "
               "a timeout of 60 s): check checkpoint.dir, your credentials and the network, "
               "then re-run the same command to resume from the last checkpoint")
    words = message.split(" ")
    for details in ([], [f"TrainkitError: {message}", "ClientError: refused"]):
        *shown, last = error_lines(message, details)
        assert len(last) <= LINE_LIMIT
        assert sum(message in line for line in shown) == 1, shown
        start, end = last.removeprefix("trainkit: ").split(" ... ")
        assert start.split(" ") == words[:len(start.split(" "))] and len(start) > 40
        assert end.split(" ") == words[-len(end.split(" ")):]


def test_a_short_message_is_the_last_line_as_it_is() -> None:
    assert error_lines("data.batch_size must be >= 1, got -4") == [
        "trainkit: data.batch_size must be >= 1, got -4"]


def test_details_are_cut_to_a_readable_size() -> None:
    lines = error_lines("short", [f"key_{i} " * 100 for i in range(40)])
    assert len(lines) == 13 and lines[-2] == "  ... and 29 more lines"
    assert all(len(line) <= 2 + 300 for line in lines[:-1])
    assert lines[0].endswith("(599 characters)")  # whitespace folded first


def test_chain_lines_walk_the_causes_outermost_first() -> None:
    try:
        try:
            raise ConnectionRefusedError("refused")
        except OSError as inner:
            raise RuntimeError("download\nfailed") from inner
    except RuntimeError as err:
        assert chain_lines(err) == ["RuntimeError: download failed",
                                    "ConnectionRefusedError: refused"]


def test_trainkit_error_keeps_its_details_apart_from_the_message() -> None:
    err = TrainkitError("what is wrong: how to fix", details=["a\nb", "", "c"])
    assert str(err) == "what is wrong: how to fix" and err.details == ["a", "b", "c"]


def test_console_command_lists_its_commands_and_refuses_unknown_ones(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("train", "launch", "data", "env", "verify-resume"))
    assert cli.main(["trian"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("trainkit: unknown command 'trian'")


def test_console_command_runs_the_module_with_its_arguments(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:  # argparse of `python -m trainkit.data`
        cli.main(["data", "verify", "nope"])
    assert stop.value.code == 2
    assert "unknown dataset nope" in capsys.readouterr().err


def test_the_entry_point_names_hydras_override_where_the_library_says_run_dir() -> None:
    from trainkit.entry.errors import hydra_words

    assert hydra_words("use another run_dir, or checkpoint.resume=null") == (
        "use another hydra.run.dir, or checkpoint.resume=null")
    path = "checkpoint /tmp/run_dir/last.pt cannot be read"  # a path is left as it is
    assert hydra_words(path) == path
