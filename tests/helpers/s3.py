"""A real S3 API over HTTP on this machine: moto's server, as s3fs tests itself.

:func:`moto_server` starts ``ThreadedMotoServer`` on a free port and yields the environment that
points boto (and so s3fs, here and in the runs the tests start) at it, with fake credentials;
:func:`s3_environment` sets it in this process while a test module runs. One server serves the
session (``moto_s3`` in tests/conftest.py); each module makes a bucket of its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass

SECRET = "trainkit-test-secret-key-0123456789"  # must appear in no run file nor log


@dataclass(frozen=True)
class S3:
    """A running server: ``env`` for a subprocess (and set in this process while it runs)."""

    endpoint: str
    env: dict[str, str]

    def bucket(self, name: str) -> str:
        """Make the bucket ``name`` (empty); returns ``s3://name``."""
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")
        client.create_bucket(Bucket=name)
        return f"s3://{name}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def moto_server() -> Iterator[S3]:
    """moto's S3 server on a free port (tests/conftest.py's ``moto_s3``: one per session)."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ACCESS_KEY_ID": "trainkit-test-key", "AWS_SECRET_ACCESS_KEY": SECRET,
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint,
           # no profile of this machine's user is read, nor an EC2 instance's credentials
           "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_CONFIG_FILE": os.devnull,
           "AWS_EC2_METADATA_DISABLED": "true",
           "no_proxy": "127.0.0.1", "NO_PROXY": "127.0.0.1"}
    try:
        yield S3(endpoint, env)
    finally:
        server.stop()


@contextlib.contextmanager
def s3_environment(server: S3) -> Iterator[S3]:
    """``server``'s environment set in this process for a block (a test module), then as it
    was."""
    before = {key: os.environ.get(key) for key in server.env}
    os.environ.update(server.env)
    try:
        yield server
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def s3_server() -> Iterator[S3]:
    """A server of its own with its environment set meanwhile (outside pytest's fixtures)."""
    with moto_server() as server, s3_environment(server):
        yield server


@contextlib.contextmanager
def dropping_endpoint(monkeypatch: object) -> Iterator[list[object]]:
    """An S3 endpoint on this machine that accepts each connection and closes it (a reset on
    every request), set as this process's ``AWS_ENDPOINT_URL`` with fake credentials and boto's
    default retries; yields the list of connections it accepted."""
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list[object] = []

    def drop() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted.append(conn)
            conn.close()

    threading.Thread(target=drop, daemon=True).start()
    for key, value in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.getsockname()[1]}",
                       "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": "/dev/null",
                       "AWS_SHARED_CREDENTIALS_FILE": "/dev/null", "no_proxy": "127.0.0.1",
                       "NO_PROXY": "127.0.0.1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(key, value)  # type: ignore[attr-defined]
    for key in ("AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)  # type: ignore[attr-defined]
    try:
        yield accepted
    finally:
        server.close()
