"""The console command answers at once where it needs no torch: ``trainkit --help`` and
``trainkit runs DIR`` import neither torch nor Hydra (importing torch is what took seconds), and
every command's help is plain text, without reST markup."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from trainkit.entry import evaluate, export, predict

# Runs the console command's main in a fresh interpreter, then says which heavy modules it loaded.
PROBE = ("import sys\nfrom trainkit.entry.cli import main\nstatus = main(sys.argv[1:])\n"
         "print([m for m in ('torch', 'hydra', 'omegaconf') if m in sys.modules], status)")


def _imported(*args: str) -> tuple[str, str]:
    result = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=REPO, capture_output=True,
                            text=True, timeout=120, check=True)
    return result.stdout.strip().splitlines()[-1], result.stdout


def test_help_and_runs_import_no_torch(tmp_path: Path) -> None:
    last, _ = _imported("--help")
    assert last == "[] 0"
    run = tmp_path / "runs" / "a"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("checkpoint: {monitor: val/acc, mode: max}\n")
    (run / ".hydra" / "overrides.yaml").write_text("- optim.lr=0.1\n")
    (run / "summary.json").write_text('{"status": "completed", "global_step": 7, '
                                      '"metrics": {"val/acc": 0.5}}\n')
    last, out = _imported("runs", str(tmp_path / "runs"))
    assert last == "[] 0"
    assert "completed" in out and "0.5" in out


@pytest.mark.parametrize("command", [evaluate, predict, export], ids=lambda m: m.__name__)
def test_help_is_plain_text(command, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) if command is export else contextlib.nullcontext():
        command.main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and len(out) > 200
    assert "``" not in out and ":mod:" not in out and ":class:" not in out

