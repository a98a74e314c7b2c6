"""``python -m trainkit <command>``: the same as the ``trainkit`` console command."""

import sys

from trainkit.entry.cli import main

sys.exit(main())
