"""``trainkit <command>``: the console command a pip install puts on the PATH, and the argument
reading the after-training commands share (``RUN_DIR key=value ...``).

Each command is the module of the same name, so ``trainkit train +exp=mnist`` is
``python -m trainkit.train +exp=mnist`` and the ``python -m`` forms keep working. Under
torchrun: ``torchrun --nproc_per_node=2 --no-python trainkit train +exp=cifar``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from trainkit.core.errors import TrainkitError, command_name, help_text

# command -> (module whose main() runs it, what it does)
COMMANDS = {
    "train": ("trainkit.train", "train with the Hydra entry point: trainkit train +exp=mnist"),
    "launch": ("trainkit.launch", "torchrun with one process per GPU, then train"),
    "data": ("trainkit.data.__main__", "download or verify datasets: trainkit data download mnist"),
    "env": ("trainkit.env", "report devices, versions and the distributed environment"),
    "checkpoint": ("trainkit.checkpoint.__main__",
                   "consolidate a sharded checkpoint directory into one file"),
    "evaluate": ("trainkit.entry.evaluate",
                 "evaluate a run's best (or last, step_N) checkpoint: trainkit evaluate RUN_DIR"),
    "predict": ("trainkit.entry.predict",
                "label images or a data split with a run's model, one row per input"),
    "export": ("trainkit.entry.export",
               "a run's model as safetensors, pt or a torch.export program, with model.json"),
    "estimate": ("trainkit.entry.estimate",
                 "peak memory per rank of a run, and what makes it fit a GPU, without one"),
    "probe": ("trainkit.probe", "measure loader, step and both; say what holds a run back"),
    "verify-resume": ("trainkit.verify_resume", "check that stopping and resuming is bit-exact"),
    "sweep": ("trainkit.entry.sweep",
              "an Optuna search over runs: trainkit sweep --trials 20 +exp=mnist +sweep=lr"),
    "runs": ("trainkit.entry.runs", "a table of the runs under a folder, the best first"),
}


def main(argv: list[str] | None = None) -> int:
    """Run ``trainkit <command> [args...]``; return its exit status."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        usage = "\n".join(f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items())
        print(f"usage: trainkit <command> [args...]\n\ncommands:\n{usage}\n\n"
              "`trainkit <command> --help` describes each one.",
              file=sys.stdout if args and args[0] in ("-h", "--help") else sys.stderr)
        if args and args[0] not in ("-h", "--help"):
            print(f"trainkit: unknown command {args[0]!r}: use one of {', '.join(COMMANDS)}",
                  file=sys.stderr)
        return 0 if args and args[0] in ("-h", "--help") else 2
    command, rest = args[0], args[1:]
    _current_folder_importable()
    module = importlib.import_module(COMMANDS[command][0])
    # The name its usage line shows (trainkit.core.errors.command_name); Hydra reads the overrides
    # from sys.argv itself.
    argv_before, sys.argv = sys.argv, [f"trainkit {command}", *rest]
    if command == "train":
        module.main()  # Hydra exits with the run's status
        return 0
    try:
        return int(module.main(rest) or 0)
    finally:
        sys.argv = argv_before


def _current_folder_importable() -> None:
    """The current folder first on ``sys.path``, as ``python -m`` puts it there: the console
    script's own first entry is its ``bin/`` folder, so ``dataset._target_=my_project.data...``
    imported under ``python -m trainkit.train`` failed under ``trainkit evaluate`` (and
    ``export``, ``predict``, ``train``) from the same folder."""
    here = os.getcwd()
    if not {"", ".", here} & set(sys.path):
        sys.path.insert(0, here)


def usage_status(args: Sequence[str], module: str, usage: str, doc: str | None) -> int | None:
    """Print a command's usage when ``args`` is empty (to stderr: exit status 2) or asks for help
    (to stdout: 0); None when the command should run."""
    if args and args[0] not in ("-h", "--help"):
        return None
    print(f"usage: {command_name(module)} {usage}\n\n{help_text(doc)}",
          file=sys.stdout if args else sys.stderr)
    return 0 if args else 2


def split_args(args: Sequence[str], options: dict[str, str], usage: str
               ) -> tuple[Path, dict[str, str], list[str]]:
    """``RUN_DIR key=value ...`` as the run folder, the command's own options (``options``:
    their defaults) and the config overrides (every other ``key=value``)."""
    positional = [a for a in args if "=" not in a]
    if len(positional) != 1:
        raise TrainkitError(f"give one run folder, then key=value settings: {usage}")
    chosen, overrides = dict(options), []
    for arg in args:
        if "=" in arg:
            key, value = arg.split("=", 1)
            if key in options:
                chosen[key] = value
            else:
                overrides.append(arg.removeprefix("+"))
    return Path(positional[0]), chosen, overrides


if __name__ == "__main__":
    sys.exit(main())
