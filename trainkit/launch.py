"""``python -m trainkit.launch`` and ``trainkit.launch.launch``, kept at their documented path:
the command is :mod:`trainkit.entry.launch`, the launcher :mod:`trainkit.distributed.torchrun`."""

import sys

from trainkit.distributed.torchrun import launch, torchrun_command
from trainkit.entry.launch import main

__all__ = ["launch", "main", "torchrun_command"]

if __name__ == "__main__":
    sys.exit(main())
