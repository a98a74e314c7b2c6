"""``python -m trainkit.data``: the offline tools (:mod:`trainkit.data.tools.cli`)."""

import sys

from trainkit.data.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
