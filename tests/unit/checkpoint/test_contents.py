"""A checkpoint's manifest names the trainkit that wrote it, from the installed metadata."""

from __future__ import annotations

import importlib.metadata

import pytest

from trainkit.checkpoint import contents


def test_the_manifest_names_the_installed_version() -> None:
    made = contents.manifest({"model": {"name": "mlp"}})
    assert made["trainkit"] == importlib.metadata.version("trainkit")


def test_a_source_tree_never_installed_says_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    # No distribution named trainkit: what metadata lookup raises when run from a bare checkout.
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    contents.trainkit_version.cache_clear()
    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    try:
        assert contents.manifest({})["trainkit"] == "unknown"
    finally:
        contents.trainkit_version.cache_clear()
