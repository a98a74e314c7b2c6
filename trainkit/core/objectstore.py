"""Locations given as fsspec URLs (``s3://``, ``gs://``, ``az://``, ``memory://``, ...).

Checkpoints and data reach object storage through fsspec and its protocol packages, which take
credentials and endpoints where their SDKs do (the environment, profiles, fsspec's own
configuration): trainkit takes none of its own, so none can end up in a run's config,
checkpoints or logs. A failure on first contact (a missing package, no credentials, no answer,
no bucket) is one line naming what to install or set (:func:`store_error`). Whether a setting
names a URL at all is :mod:`~trainkit.core.location`'s to say.
"""

from __future__ import annotations

import logging
from typing import Any

from trainkit.core.errors import ConfigError, TrainkitError, one_line

# the package that serves each protocol, and the trainkit extra that installs it
_PACKAGES = {"s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"),
             "gcs": ("gcsfs", "gcs"), "az": ("adlfs", "azure"), "abfs": ("adlfs", "azure"),
             "abfss": ("adlfs", "azure")}
_CREDENTIALS = {"s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)",
                "gs": "GOOGLE_APPLICATION_CREDENTIALS (or run gcloud auth application-default "
                      "login)",
                "az": "AZURE_STORAGE_CONNECTION_STRING (or AZURE_STORAGE_ACCOUNT_NAME and "
                      "AZURE_STORAGE_ACCOUNT_KEY)"}
_ENDPOINTS = {"s3": "AWS_ENDPOINT_URL"}
# The first contact (quick=True): one try of a few seconds, so that an endpoint that does not
# answer is said at once -- the package's defaults retry for a minute or more, which is what
# the hours of saves afterwards want, from the filesystem made without ``quick``.
_QUICK = {"s3": {"config_kwargs": {"connect_timeout": 5, "read_timeout": 10,
                                   "retries": {"total_max_attempts": 1}}}}


def protocol(url: str) -> str:
    """The URL's protocol, as its family is known (``s3a`` -> ``s3``, ``abfs`` -> ``az``)."""
    name = url.split("://", 1)[0].lower()
    return {"s3a": "s3", "gcs": "gs", "abfs": "az", "abfss": "az"}.get(name, name)


def filesystem(url: str, key: str, *, quick: bool = False) -> tuple[Any, str]:
    """The fsspec filesystem that serves ``url`` and the path in it (no slash at its end);
    ``quick``: one of its own that tries each request once, briefly (a first contact).

    Raises:
        ConfigError: an unknown protocol, or one whose package is not installed (``key``
            names the setting that gave the URL).
    """
    import fsspec

    # boto's INFO lines ("Found credentials in environment variables") would reach train.log
    for noisy in ("botocore", "aiobotocore", "s3fs"):
        if logging.getLogger(noisy).level == logging.NOTSET:
            logging.getLogger(noisy).setLevel(logging.WARNING)
    name = url.split("://", 1)[0].lower()
    try:
        options = {"skip_instance_cache": True, **_QUICK.get(protocol(url), {})} if quick else {}
        fs, path = fsspec.core.url_to_fs(url, **options)
        if quick and isinstance(getattr(fs, "retries", None), int):
            fs.retries = 1  # s3fs's own retries, over botocore's (this instance is ours alone)
    except ImportError:
        package, extra = _PACKAGES.get(name, (f"the fsspec package for {name}://", None))
        how = f"pip install 'trainkit[{extra}]' (or {package})" if extra else "install it"
        raise ConfigError(f"{key}={url}: the {name}:// protocol needs {package}, which is not "
                          f"installed: {how}") from None
    except ValueError as err:
        raise ConfigError(f"{key}={url}: {one_line(err, 60)}; use a protocol fsspec knows "
                          "(s3://, gs://, az://, ...) or a local path") from None
    return fs, path.rstrip("/")


def join(root: str, name: str) -> str:
    """``root/name`` for fsspec paths and URLs."""
    return f"{root.rstrip('/')}/{name}"


def store_error(err: BaseException, url: str, key: str) -> TrainkitError | None:
    """One line for a failure to reach ``url`` that the user fixes by setting something; None
    for any other error (the caller's own message says it)."""
    names = {cls.__name__ for cls in type(err).__mro__}
    family = protocol(url)
    if names & {"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError",
                "ClientAuthenticationError"} or "credential" in str(err).lower():
        where = _CREDENTIALS.get(family, f"the credentials your {family}:// package reads")
        return TrainkitError(f"{key}={url}: no credentials for {family}:// were found: set "
                             f"{where}")
    if names & {"ConnectionError", "ConnectionClosedError", "ProxyConnectionError",
                "ConnectTimeoutError",
                "ClientConnectorError", "ServiceRequestError", "TimeoutError"}:
        endpoint = _ENDPOINTS.get(family)
        fix = f", or set {endpoint} to its endpoint" if endpoint else ""
        return TrainkitError(f"{key}={url}: the storage cannot be reached ({one_line(err, 90)})"
                             f": check the network{fix}")
    if isinstance(err, PermissionError):
        return TrainkitError(f"{key}={url}: access denied ({one_line(err, 60)}): use "
                             "credentials allowed to read and write it")
    if isinstance(err, FileNotFoundError) and "bucket" in str(err).lower():
        bucket = url.split("://", 1)[1].split("/", 1)[0]
        return TrainkitError(f"{key}={url}: the bucket {bucket} does not exist: create it or "
                             f"fix {key}")
    return None
