"""``python -m trainkit.verify_resume``, kept at its documented path: the check is
:mod:`trainkit.entry.verify_resume`."""

import sys

from trainkit.entry.verify_resume import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
