"""``python -m trainkit.probe``, kept at its documented path: the probe is
:mod:`trainkit.entry.probe`."""

import sys

from trainkit.entry.probe import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
