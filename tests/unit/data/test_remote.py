"""Data on object storage: an unreachable store is said in one line at the first contact."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.helpers.s3 import dropping_endpoint
from trainkit.core.errors import TrainkitError
from trainkit.data.remote import fetch_files, fetch_tree


@pytest.mark.parametrize("fetch", [lambda root: fetch_files(root, ["train.bin"]),
                                   lambda root: fetch_tree(root)], ids=["files", "folder"])
def test_an_endpoint_that_drops_every_connection_is_tried_once_at_the_first_contact(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any, fetch: Callable[[str], Any]) -> None:
    """One request (which aiohttp may send again once on a dropped connection), not s3fs's 5
    retries over botocore's, each with backoff; nothing is cached."""
    pytest.importorskip("s3fs")
    monkeypatch.setenv("TRAINKIT_CACHE_DIR", str(tmp_path / "cache"))
    reached = r"^data.root=s3://b/data: the storage cannot be reached \(.*\): check the network"
    with dropping_endpoint(monkeypatch) as accepted, pytest.raises(TrainkitError, match=reached):
        fetch("s3://b/data")
    assert 1 <= len(accepted) <= 2
    assert not any(p.is_file() for p in (tmp_path / "cache").rglob("*"))
