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
import os
import sys
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """Inside: transformers and datasets (those imported) log errors only and show no
    progress bars; after: their verbosity and bars as they were."""
    undo: list[Callable[[], None]] = []
    if "transformers" in sys.modules and "TRANSFORMERS_VERBOSITY" not in os.environ:
        from transformers.utils import logging as hf_logging

        level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        undo.append(lambda: hf_logging.set_verbosity(level))
        if bars:
            undo.append(hf_logging.enable_progress_bar)
    if "datasets" in sys.modules and "DATASETS_VERBOSITY" not in os.environ:
        import datasets
        from datasets.utils import logging as ds_logging

        level, bars = ds_logging.get_verbosity(), datasets.is_progress_bar_enabled()
        ds_logging.set_verbosity_error()
        datasets.disable_progress_bars()
        undo.append(lambda: ds_logging.set_verbosity(level))
        if bars:
            undo.append(datasets.enable_progress_bars)
    try:
        yield
    finally:
        for step in reversed(undo):
            step()
