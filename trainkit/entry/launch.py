"""Start distributed training without typing torchrun.

``python -m trainkit.launch +exp=cifar`` runs ``torchrun --standalone --nproc-per-node=N -m
trainkit.train +exp=cifar`` with one process per visible GPU (one process on a CPU-only machine),
passing every override through. It exits as a single process does (torchrun itself exits 1): 75
when the run stopped on a signal after saving, 2 on bad input, the worker's own error line last.
The machinery is torchrun's own (:mod:`trainkit.distributed.torchrun`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from trainkit.core.errors import TrainkitError, command_name, print_error
from trainkit.distributed.torchrun import run_torchrun, torchrun_command


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the launcher's own flags, then run torchrun in this process."""
    parser = argparse.ArgumentParser(
        prog=command_name("trainkit.launch"),
        description="torchrun with one process per visible GPU (one on CPU); every other "
                    "argument is passed to `python -m trainkit.train`.")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="processes to start (default: visible GPUs, 1 without CUDA)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart the whole group this many times when a process dies; "
                             "it resumes from the run's last checkpoint")
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    args, overrides = parser.parse_known_args(argv)
    try:
        command = torchrun_command(overrides, nproc=args.nproc_per_node,
                                   max_restarts=args.max_restarts)
    except TrainkitError as err:
        print_error(str(err), err.details)
        return 2
    print(" ".join(command[1:]).replace("-m torch.distributed.run", "torchrun", 1), flush=True)
    if args.dry_run:
        return 0
    # In this process, not a child: signals (Ctrl-C, SIGTERM from a scheduler) reach torchrun's
    # agent, which forwards them to the workers.
    return run_torchrun(command[3:])  # what follows `python -m torch.distributed.run`


if __name__ == "__main__":
    sys.exit(main())
