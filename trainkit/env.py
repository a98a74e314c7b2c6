"""``python -m trainkit.env``, kept at its documented path: the report is
:mod:`trainkit.entry.env`."""

import sys

from trainkit.entry.env import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
