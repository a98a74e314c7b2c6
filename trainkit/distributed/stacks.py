"""Where a hung process is: every thread's Python stack, dumped to ``hangs/rank<R>.txt``."""

from __future__ import annotations

import faulthandler
import sys
import time
from pathlib import Path

from trainkit.core.errors import one_line

HANG_DIR = "hangs"


def dump_stacks(run_dir: Path | None, rank: int, what: str) -> str:
    """Append every thread's Python stack to ``run_dir/hangs/rank<R>.txt`` (stderr without a
    run dir); returns where they went.

    faulthandler walks the threads' frames without running their code, so it also shows a
    thread stuck in C code (a collective, a lock, a read from a dead disk).
    """
    header = (f"trainkit hang watchdog, {time.strftime('%Y-%m-%d %H:%M:%S')}: rank "
              f"{rank}, {what}\n")
    if run_dir is not None:
        path = run_dir / HANG_DIR / f"rank{rank}.txt"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as file:
                file.write(header)
                file.flush()
                faulthandler.dump_traceback(file, all_threads=True)
                file.write("\n")
            return str(path)
        except OSError as err:  # a full or read-only disk may be the very cause
            header += f"(could not write {path}: {one_line(err)})\n"
    if sys.__stderr__ is None:  # no stderr at all (pythonw, some daemons)
        return "nowhere (no run dir, no stderr)"
    sys.__stderr__.write(header)
    sys.__stderr__.flush()
    faulthandler.dump_traceback(sys.__stderr__, all_threads=True)
    return "stderr"


def stacks_place(run_dir: Path | None, rank: int, world_size: int) -> str:
    """Where :func:`dump_stacks` puts the stacks of the ranks, as words for a log line."""
    if run_dir is None:
        return "each process's stderr"
    return str(run_dir / HANG_DIR / ("rank<R>.txt" if world_size > 1 else f"rank{rank}.txt"))


def where(thread_id: int) -> str | None:
    """The innermost Python frame of a thread, as ``function (file:line)``."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return None
    return f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name}:{frame.f_lineno})"
