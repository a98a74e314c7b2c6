"""``python -m trainkit.evaluate RUN_DIR [ckpt=best] [overrides]``, the documented path of
:mod:`trainkit.entry.evaluate` (``trainkit evaluate``)."""

import sys

from trainkit.entry.evaluate import evaluate_run, main

__all__ = ["evaluate_run", "main"]

if __name__ == "__main__":
    sys.exit(main())
