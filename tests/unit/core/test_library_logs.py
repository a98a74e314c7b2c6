"""The Hugging Face libraries quieted where trainkit calls them, and put back after."""

from __future__ import annotations

import pytest

from trainkit.core.library_logs import quiet_libraries

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")


def _state() -> tuple[int, bool, int, bool]:
    from datasets.utils import logging as ds_logging
    from transformers.utils import logging as hf_logging

    return (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(),
            ds_logging.get_verbosity(), datasets.is_progress_bar_enabled())


def test_both_libraries_log_errors_only_inside_and_as_before_after(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    monkeypatch.delenv("DATASETS_VERBOSITY", raising=False)
    before = _state()
    with quiet_libraries():
        assert _state() == (40, False, 40, False)  # logging.ERROR, no bars
    assert _state() == before


def test_a_library_whose_verbosity_variable_is_set_is_left_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATASETS_VERBOSITY", "info")
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    before = _state()
    with quiet_libraries():
        inside = _state()
    assert inside[:2] == (40, False) and inside[2:] == before[2:]
    assert _state() == before
