"""``trainkit verify-resume --cmd "python my_script.py --run-dir {run_dir}"``: does your own
script resume bit for bit?

The command runs three times, each in a process group of its own, ``{run_dir}`` replaced: to its
end (``straight``); in a second run dir (``stopped``), sent SIGTERM once a file matches
``--signal-after`` (default: its first checkpoint, ``**/checkpoints/*.pt``; a checkpoint is
named ``.pt`` only once complete), where it must exit 75; again there (``resumed``), to exit 0.
Then every final checkpoint (each ``last.pt`` under the run dirs) is compared entry by entry,
the ``manifest`` aside. The script learns which run it is in ``TRAINKIT_VERIFY_RUN``. Exit
status: 0 equal, 1 naming the first entry that differs, 2 when a run fails or does not stop as
asked (one line; each run's output in ``<work>/<run>.log``).
"""

from __future__ import annotations

import glob
import math
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from trainkit.checkpoint.files import load_checkpoint
from trainkit.core.errors import TrainkitError
from trainkit.core.signals import EXIT_PREEMPTED
from trainkit.core.tree import tree_leaves

PLACEHOLDER = "{run_dir}"
SIGNAL_AFTER = "**/checkpoints/*.pt"
_IGNORED = ("manifest", "_path", "config")  # name the run (its host, folder), not its state
_POLL_S = 0.01


def verify_command(command: str, work: Path, signal_after: str = SIGNAL_AFTER) -> int:
    """Run ``command`` straight, stopped half-way and resumed under ``work``; print one line;
    return 0 (the final checkpoints are equal) or 1 (they differ).

    Raises:
        TrainkitError: ``command`` has no ``{run_dir}``, or a run failed or did not stop.
    """
    args = command_args(command)
    straight, stopped = work / "straight", work / "stopped"
    _finish(_start(args, straight, work, "straight"), work, "straight")
    first = _stop_half_way(_start(args, stopped, work, "stopped"), stopped, work, signal_after)
    _finish(_start(args, stopped, work, "resumed"), work, "resumed")
    finals = _finals(straight)
    if not finals:
        raise TrainkitError(f"the script wrote no final checkpoint (checkpoints/last.pt) under "
                            f"its run dir {straight}: is {PLACEHOLDER} its run dir?")
    differences = [f"{name}: {line}" for name in finals
                   for line in differences_in_order(_load(straight / name),
                                                    _load(stopped / name))]
    missing = sorted(set(_finals(stopped)) ^ set(finals))
    differences = [f"{name}: only in one run" for name in missing] + differences
    stop = first.relative_to(stopped)
    if differences:
        more = f" (and {len(differences) - 1} more)" if len(differences) > 1 else ""
        print(f"verify-resume: MISMATCH -- stopped by SIGTERM after {stop} and re-run, the "
              f"script ends elsewhere: {differences[0]}{more}", flush=True)
        return 1
    print(f"verify-resume: OK -- stopped by SIGTERM after {stop} and re-run, the script ends "
          f"with bitwise the same {', '.join(map(str, finals))} as run straight through",
          flush=True)
    return 0


def command_args(command: str) -> list[str]:
    """``command`` split as a shell would (no shell runs it); it must hold ``{run_dir}``.

    Raises:
        TrainkitError: it does not.
    """
    args = shlex.split(command)
    if not any(PLACEHOLDER in arg for arg in args):
        raise TrainkitError(f"--cmd must contain {PLACEHOLDER}, where each run's folder goes: "
                            f'e.g. --cmd "python my_script.py --run-dir {PLACEHOLDER}"')
    return args


def _start(args: list[str], run_dir: Path, work: Path, name: str) -> subprocess.Popen:
    env = {**os.environ, "TRAINKIT_VERIFY_RUN": name}
    command = [arg.replace(PLACEHOLDER, str(run_dir)) for arg in args]
    with open(work / f"{name}.log", "ab") as out:  # the child keeps its own copy
        try:
            return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)  # its group: torchrun's ranks too
        except OSError as err:
            raise TrainkitError(f"cannot run {command[0]!r}: {err.strerror}") from None


def _finish(proc: subprocess.Popen, work: Path, name: str) -> None:
    status = _wait(proc)
    if status != 0:
        raise TrainkitError(f"the {name} run of the script exited with status {status}, not 0",
                            details=_tail(work / f"{name}.log"))


def _stop_half_way(proc: subprocess.Popen, run_dir: Path, work: Path, pattern: str) -> Path:
    """SIGTERM to ``proc``'s group once a file matching ``pattern`` exists; the file."""
    found: list[str] = []
    while proc.poll() is None and not (found := glob.glob(pattern, root_dir=run_dir,
                                                          recursive=True)):
        time.sleep(_POLL_S)
    if found:
        os.killpg(proc.pid, signal.SIGTERM)  # as a scheduler does: the whole job
        # where step_N.pt and last.pt both match and are both there, name the step's
        found.sort(key=lambda path: (Path(path).name == "last.pt", path))
    status = _wait(proc)
    log = _tail(work / "stopped.log")
    if not found:
        raise TrainkitError(f"the script ended (status {status}) before a file matched "
                            f"--signal-after {pattern} in its run dir: save a checkpoint "
                            "before its end, or name the file to wait for", details=log)
    if status == 0:
        raise TrainkitError(f"the script ended (status 0) before SIGTERM reached it (sent once "
                            f"{found[0]} existed): give it more steps after its first "
                            "checkpoint", details=log)
    if status != EXIT_PREEMPTED:
        raise TrainkitError(f"after SIGTERM the script exited with status {status}, not 75: "
                            "run its body inside `with trainkit.preemptible():`, or exit with "
                            "trainkit.EXIT_PREEMPTED when fit returns status preempted",
                            details=log)
    # the step's own file rather than last.pt, written beside it
    return run_dir / min(found, key=lambda name: (Path(name).name == "last.pt", name))


def _wait(proc: subprocess.Popen) -> int:
    try:
        return proc.wait()
    finally:  # interrupted (Ctrl-C): its group goes too, no orphan keeps training
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _tail(log: Path, lines: int = 6) -> list[str]:
    text = log.read_text(errors="replace").rstrip().splitlines() if log.exists() else []
    return [*text[-lines:], f"(the run's output: {log})"]


def _finals(run_dir: Path) -> list[Path]:
    return sorted(path.relative_to(run_dir) for path in run_dir.rglob("last.pt"))


def _load(path: Path) -> Any:
    return load_checkpoint(path) if path.exists() else {}


def differences_in_order(a: Any, b: Any) -> Iterator[str]:
    """``path: description`` for every leaf where two checkpoints differ, in ``a``'s order (its
    models first, as saved), then the leaves ``b`` alone has."""
    def leaves(tree: Any) -> dict[str, Any]:
        if isinstance(tree, dict):
            tree = {k: v for k, v in tree.items() if k not in _IGNORED}
        return dict(tree_leaves(tree))

    flat_a, flat_b = leaves(a), leaves(b)
    for path in [*flat_a, *(p for p in flat_b if p not in flat_a)]:
        x, y = flat_a.get(path), flat_b.get(path)
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                yield (f"{path} has shape/dtype {tuple(x.shape)}/{x.dtype} vs "
                       f"{tuple(y.shape)}/{y.dtype}")
            elif not _bitwise_equal(x, y):
                diff = (f"max abs difference {(x.double() - y.double()).abs().max().item():.3g}"
                        if x.is_floating_point() and x.numel() else "values differ")
                yield f"{path} differs ({diff})"
        elif type(x) is not type(y) or (x != y and not (_nan(x) and _nan(y))):
            yield f"{path} differs ({x!r} vs {y!r})"


def _bitwise_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal values, or equal bits (NaN where the other has the same NaN)."""
    if torch.equal(x, y):
        return True
    flat_x, flat_y = x.detach().reshape(-1), y.detach().reshape(-1)
    return x.is_floating_point() and torch.equal(flat_x.view(torch.uint8),
                                                 flat_y.view(torch.uint8))


def _nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)
