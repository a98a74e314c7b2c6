"""``python -m trainkit.launch`` and ``trainkit.launch.launch``, kept at their documented path:
the launcher is :mod:`trainkit.distributed.launch`."""

import sys

from trainkit.distributed.launch import launch, main, torchrun_command

__all__ = ["launch", "main", "torchrun_command"]

if __name__ == "__main__":
    sys.exit(main())
