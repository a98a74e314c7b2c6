"""The Hugging Face libraries' chatter (warnings, load reports, progress bars) off where
trainkit calls them, through their public verbosity switches, and as it was after.

transformers' load report (a table with terminal colour codes), its "Loading weights" and
"Writing model shards" bars and datasets' "Generating train split" bars say nothing a run's own
lines do not; under tmux or in ``train.log`` they are noise. Errors still show. Set the
libraries' own ``TRANSFORMERS_VERBOSITY`` / ``DATASETS_VERBOSITY`` (e.g. ``info``) to see them:
then their settings are left alone. Nothing changes at ``import trainkit``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from types import ModuleType

# library: its own verbosity variable, its logging module, and where its progress-bar switches
# are with their names (is enabled, disable, enable): each library's public API
_LIBRARIES = {
    "transformers": ("TRANSFORMERS_VERBOSITY", "transformers.utils.logging",
                     "transformers.utils.logging",
                     ("is_progress_bar_enabled", "disable_progress_bar", "enable_progress_bar")),
    "datasets": ("DATASETS_VERBOSITY", "datasets.utils.logging", "datasets",
                 ("is_progress_bar_enabled", "disable_progress_bars", "enable_progress_bars")),
}


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """Inside: transformers and datasets (those imported) log errors only and show no
    progress bars; after: their verbosity and bars as they were."""
    undo: list[Callable[[], None]] = []
    for name, (variable, logs, bars, switches) in _LIBRARIES.items():
        if name in sys.modules and variable not in os.environ:
            undo += _quiet(importlib.import_module(logs), importlib.import_module(bars),
                           *switches)
    try:
        yield
    finally:
        for step in reversed(undo):
            step()


def _quiet(logs: ModuleType, bars: ModuleType, shown: str, hide: str,
           show: str) -> list[Callable[[], None]]:
    """One library's errors only and bars off; what puts them back as they were."""
    level, were_shown = logs.get_verbosity(), getattr(bars, shown)()
    logs.set_verbosity_error()
    getattr(bars, hide)()
    undo: list[Callable[[], None]] = [lambda: logs.set_verbosity(level)]
    if were_shown:
        undo.append(getattr(bars, show))
    return undo
