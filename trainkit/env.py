"""``python -m trainkit.env``, kept at its documented path: the report is
:mod:`trainkit.observe.env`."""

import sys

from trainkit.observe.env import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
