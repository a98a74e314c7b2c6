"""``python -m tests.helpers.verify_pause MARKER STEP SCRIPT ARGS...``: run ``SCRIPT`` (a path)
as ``python SCRIPT ARGS`` would; in verify-resume's stopped run (``TRAINKIT_VERIFY_RUN=stopped``)
it writes ``MARKER`` after its ``STEP``-th optimizer step and waits there until a signal came.

With ``--signal-after`` naming the marker (``MARKER`` = ``{run_dir}/paused``), the SIGTERM that
``trainkit verify-resume --cmd`` sends always finds the script mid-run, however loaded the
machine: the test waits on events, not on time. The straight and resumed runs are the script
alone.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any

from tests.helpers.pause import wait_for_a_signal


def main(argv: list[str]) -> None:
    marker, step, script, *args = argv
    if os.environ.get("TRAINKIT_VERIFY_RUN") == "stopped":
        from torch.optim.optimizer import register_optimizer_step_post_hook

        steps = 0

        def after_step(optimizer: Any, *_: Any) -> None:
            nonlocal steps
            steps += 1
            if steps == int(step):
                wait_for_a_signal(marker)

        register_optimizer_step_post_hook(after_step)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` has it
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
