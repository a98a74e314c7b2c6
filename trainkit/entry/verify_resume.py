"""``python -m trainkit.verify_resume +exp=mnist [overrides]``: does resuming change your run?

Trains your own config for a few steps twice -- once straight through, once stopped at a step
(as a preemption would stop it) and resumed by the same command -- then compares the two final
checkpoints bit for bit: weights, optimizer, scheduler, precision, EMA, RNG and loop state. When
they differ it says where, and whether the difference was already there at the stop (the run
itself is not deterministic) or appeared after the resume (something was not restored). The runs
use deterministic algorithms (cuDNN, cuBLAS's workspace, ``torch.use_deterministic_algorithms``),
so that on a GPU a mismatch is about resuming, not about the kernels.

With ``--cmd "python my_script.py --run-dir {run_dir}"`` it checks your own script instead
(:mod:`trainkit.entry.verify_script`): run to its end, stopped by SIGTERM after its first
checkpoint and re-run, then every tensor of the final checkpoints compared.

Exit status: 0 when the runs match bitwise, 1 when they differ, 2 on bad input.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir

from trainkit.checkpoint.files import load_checkpoint
from trainkit.core.cuda_settings import deterministic_algorithms
from trainkit.core.errors import TrainkitError, command_name
from trainkit.core.tree import tree_leaves
from trainkit.entry.errors import errors_as_one_line
from trainkit.entry.train import CONFIG_DIR, train
from trainkit.entry.verify_script import SIGNAL_AFTER, command_args, verify_command

# Entries that name the run rather than describe its state.
_IGNORED = ("manifest", "_path", "config")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=command_name("trainkit.verify_resume"),
        description="Check that stopping and resuming your run changes nothing, bit for bit.")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--stop-at", type=int, default=None,
                        help="step to stop at (default: a random one)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep both run directories under this folder")
    parser.add_argument("--cmd", default=None,
                        help='your own script instead of a config: a command with {run_dir}, '
                             'e.g. "python my_script.py --run-dir {run_dir}"')
    parser.add_argument("--signal-after", default=SIGNAL_AFTER, metavar="GLOB",
                        help="with --cmd: SIGTERM once a file under the run dir matches this "
                             f"(default: {SIGNAL_AFTER}, its first checkpoint)")
    parser.add_argument("overrides", nargs="*", help="the overrides you pass to trainkit.train")
    args = parser.parse_args(argv)
    with errors_as_one_line():
        if args.cmd is not None:
            return _verify_script(args, sys.argv[1:] if argv is None else argv)
        return _verify(args)
    return 2  # unreachable: errors exit inside the context


def _verify(args: argparse.Namespace) -> int:
    if args.steps < 2:
        raise TrainkitError(f"--steps must be at least 2, got {args.steps}")
    stop_at = args.stop_at or random.randint(1, args.steps - 1)
    if not 0 < stop_at < args.steps:
        raise TrainkitError(f"--stop-at must be between 1 and {args.steps - 1}, got {stop_at}")
    # Exactly `steps` steps (an epoch has at least one), and the straight run saves at the stop
    # step too, so the two runs can be compared there.
    forced = [f"trainer.max_steps={args.steps}", f"trainer.max_epochs={args.steps}",
              f"checkpoint.every_n_steps={stop_at}", "checkpoint.keep_last=1000",
              "checkpoint.every_n_minutes=0", "checkpoint.resume=auto"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[*args.overrides, *forced])
    work = _work_dir(args.keep)
    try:
        straight, resumed = work / "straight", work / "resumed"
        print(f"verify_resume: {args.steps} steps straight, then stopped at step {stop_at} "
              f"and resumed, with deterministic algorithms; runs in {work}", flush=True)
        # Deterministic kernels (cuDNN, cuBLAS, torch's own) for all three runs, set before CUDA
        # is first used: a mismatch it reports is then about resuming, not about the kernels.
        with deterministic_algorithms():
            train(cfg, straight)
            if train(cfg, resumed, stop_at_step=stop_at)["status"] != "preempted":
                raise TrainkitError(f"the run ended before step {stop_at}: lower --stop-at")
            train(cfg, resumed)
        return _report(straight / "checkpoints", resumed / "checkpoints", stop_at, args.steps)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


def _verify_script(args: argparse.Namespace, argv: list[str]) -> int:
    """``--cmd``: the script run straight, stopped and resumed; its final checkpoints compared."""
    given = {arg.split("=")[0] for arg in argv}
    wrong = sorted(given & {"--steps", "--stop-at"}) + (["overrides"] if args.overrides else [])
    if wrong:
        raise TrainkitError(f"--cmd runs your script as it is: {', '.join(wrong)} apply to a "
                            "config's run only (the script decides its length)")
    command_args(args.cmd)  # checked before any folder is made
    work = _work_dir(args.keep)
    try:
        return verify_command(args.cmd, work, args.signal_after)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


def _work_dir(keep: Path | None) -> Path:
    """A new folder for the two runs: under ``keep`` (which must exist), else a temporary one."""
    try:
        return Path(tempfile.mkdtemp(prefix="verify_resume_", dir=keep))
    except OSError as err:  # missing, a file, not writable: say which folder, not a traceback
        raise TrainkitError(f"--keep {keep}: cannot make a folder there ({err.strerror}); give an "
                            "existing, writable folder (mkdir -p it first)") from err


def _load(checkpoints: Path, name: str) -> dict[str, Any]:
    """``<name>.pt``, or under ``trainer.strategy=fsdp`` the directory ``<name>`` whole."""
    if (checkpoints / f"{name}.pt").exists() or not (checkpoints / name).is_dir():
        return load_checkpoint(checkpoints / f"{name}.pt")
    from trainkit.checkpoint.consolidate import load_full

    return load_full(checkpoints / name)


def _report(straight: Path, resumed: Path, stop_at: int, steps: int) -> int:
    at_end = _differences(_load(straight, "last"), _load(resumed, "last"))
    if not at_end:
        print(f"verify_resume: OK -- stopping at step {stop_at} and resuming gives bitwise the "
              f"same state after {steps} steps as running straight through")
        return 0
    name = f"step_{stop_at:09d}"
    at_stop = _differences(_load(straight, name), _load(resumed, name))
    print(f"verify_resume: MISMATCH -- {len(at_end)} entries differ after {steps} steps:")
    for line in at_end[:20]:
        print(f"  {line}")
    if at_stop:
        print(f"They already differed at step {stop_at}, before any resume ({at_stop[0]}): the "
              "training itself is not deterministic (nondeterministic kernels, data loader "
              "workers, unseeded randomness), so resumed runs cannot match either.")
    else:
        print(f"At step {stop_at} both runs were identical: state that the checkpoint does not "
              "carry (or that is not restored) changed the resumed run.")
    return 1


def _differences(a: Any, b: Any) -> list[str]:
    """``path: description`` for every leaf where two checkpoint trees differ."""
    found = []
    flat_a, flat_b = (dict(tree_leaves({k: v for k, v in tree.items() if k not in _IGNORED}))
                      for tree in (a, b))
    for path in sorted(flat_a.keys() | flat_b.keys()):
        x, y = flat_a.get(path), flat_b.get(path)
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                found.append(f"{path}: shape/dtype {tuple(x.shape)}/{x.dtype} vs "
                             f"{tuple(y.shape)}/{y.dtype}")
            elif not torch.equal(x, y):
                diff = (x.double() - y.double()).abs().max().item() if x.is_floating_point() \
                    else "-"
                found.append(f"{path}: max abs difference {diff}")
        elif x != y:
            found.append(f"{path}: {x!r} vs {y!r}")
    return found


if __name__ == "__main__":
    sys.exit(main())
