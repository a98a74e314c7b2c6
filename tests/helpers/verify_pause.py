"""``python -m tests.helpers.verify_pause MARKER STEP SCRIPT ARGS...``: run ``SCRIPT`` (a path)
as ``python SCRIPT ARGS`` would; in verify-resume's stopped run (``TRAINKIT_VERIFY_RUN=stopped``)
it writes ``MARKER`` after its ``STEP``-th optimizer step and waits there until a signal came.

"Came" counts a signal that arrived before the wait began too (through ``signal``'s wakeup fd,
which sees every signal whatever handler is installed): verify-resume signals once the first
checkpoint (or, with ``--signal-after`` naming it, the marker) exists, so the SIGTERM always finds
the script mid-run, however loaded the machine. The straight and resumed runs run it alone.
"""

from __future__ import annotations

import os
import runpy
import select
import signal
import sys
from typing import Any

LONGEST_S = 240.0  # a test that never signals fails on its own timeout, not by a stuck child


def main(argv: list[str]) -> None:
    marker, step, script, *args = argv
    if os.environ.get("TRAINKIT_VERIFY_RUN") == "stopped":
        from torch.optim.optimizer import register_optimizer_step_post_hook

        heard, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)  # each signal: a byte here
        steps = 0

        def after_step(optimizer: Any, *_: Any) -> None:
            nonlocal steps
            steps += 1
            if steps == int(step):
                with open(marker + ".tmp", "w") as file:
                    file.write(str(os.getpid()))
                os.replace(marker + ".tmp", marker)  # whole or absent
                select.select([heard], [], [], LONGEST_S)  # returns at once if one came before

        register_optimizer_step_post_hook(after_step)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` has it
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
