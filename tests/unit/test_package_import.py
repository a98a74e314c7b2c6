"""``import trainkit`` pauses the garbage collector for its imports only."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import REPO


def test_import_restores_the_collector_state_and_runs_no_full_collection() -> None:
    code = textwrap.dedent("""
        import gc
        full = []
        gc.callbacks.append(lambda phase, info: phase == "stop" and info["generation"] == 2
                            and full.append(info))
        import trainkit  # imports torch: without the pause, full collections run meanwhile
        print(gc.isenabled(), len(full))
        gc.disable()
        import importlib
        importlib.reload(trainkit)  # a collector the caller turned off stays off
        print(gc.isenabled())
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["True", "0", "False"]
