"""``import trainkit`` changes nothing global; trainkit uses no private API of its dependencies."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

from tests.conftest import REPO


def test_import_leaves_the_garbage_collector_as_it_was() -> None:
    code = textwrap.dedent("""
        import gc
        gc.set_threshold(1234, 11, 12)
        full = []
        gc.callbacks.append(lambda phase, info: phase == "stop" and info["generation"] == 2
                            and full.append(info))
        import trainkit
        print(gc.isenabled(), gc.get_threshold(), gc.get_freeze_count())
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "True (1234, 11, 12) 0"


# What the last round used to shave start-up and exit time, and must not come back: Hydra's
# private modules, CPython's private exit hook, a process exit that skips the interpreter's
# teardown, and pausing or freezing the garbage collector.
FORBIDDEN = re.compile(r"hydra\._internal|_run_exitfuncs|gc\.(disable|freeze)\(|\bos\._exit\(")
# os._exit where no other exit is possible: the hang watchdog's abort (the main thread is stuck)
# and a DataLoader worker's thread ending the worker on its parent's SIGTERM.
ALLOWED_EXITS = {"watchdog.py", "signals.py"}


def test_no_module_uses_private_apis_or_skips_the_interpreters_exit() -> None:
    found = []
    for path in sorted((REPO / "trainkit").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            match = FORBIDDEN.search(line)
            if match and not (match.group(0) == "os._exit(" and path.name in ALLOWED_EXITS):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, found
