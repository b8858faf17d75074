"""Reading shards from a store that may fail: bounded retries, bounded waits, and one clear error naming the URL.

The bound is botocore's, the one S3 users already set: each request is tried `AWS_MAX_ATTEMPTS` times in all
(`AWS_RETRY_MODE`, `~/.aws/config`; botocore's default, legacy mode: 5 attempts), each attempt waiting at most
s3fs's connect timeout (5 s) and read timeout (15 s), which fsspec's `FSSPEC_S3` sets:
`FSSPEC_S3='{"config_kwargs": {"connect_timeout": 5, "read_timeout": 15}}'`. s3fs adds retry loops of its
own on top (5 tries, twice nested for a read), which multiply botocore's into minutes of silence (a dropped
connection: 250 requests over 195 s); the loader's S3 filesystem turns them off. A connection cut after the
answer began (which botocore cannot retry, the request having succeeded) is read again once, with a warning.

What the user meets: missing credentials raise at once; a store that does not answer within the bound
raises a StoreError (an OSError: at start-up one line and exit 2) naming the URL, the attempts, the time and
how to change the bound. Neither is a bad shard: `on_bad_shard = "skip"` never skips a shard because the
store failed, only because the shard itself is unusable (or gone).
"""

from __future__ import annotations

import http.client
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec.config
from fsspec.core import url_to_fs

try:  # aiohttp and botocore come with s3fs (the `s3` extra); without them no S3 error can occur
    from aiohttp import ClientError as AiohttpError
    from botocore import exceptions as botocore_errors

    CLIENT_ERRORS: tuple[type[BaseException], ...] = (AiohttpError,)
except ImportError:
    botocore_errors, CLIENT_ERRORS = None, ()


def _botocore(*names: str) -> tuple[type[BaseException], ...]:
    return tuple(getattr(botocore_errors, name) for name in names) if botocore_errors else ()


logger = logging.getLogger(__name__)

T = TypeVar("T")

CREDENTIAL_ERRORS = _botocore("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError")
# Failures of the request itself, which botocore retried AWS_MAX_ATTEMPTS times before raising them.
RETRIED_BY_BOTOCORE = _botocore("ConnectionError", "ConnectionClosedError", "ReadTimeoutError")
# The network failing, not the data: worth reading again, never a reason to skip a shard.
TRANSIENT_ERRORS = (
    *_botocore("HTTPClientError", "ConnectionError", "IncompleteReadError"),
    *CLIENT_ERRORS,
    http.client.IncompleteRead,
    ConnectionError,
    TimeoutError,
)
READS = 2  # a read whose answer was cut short is read once more
BOUND_HINT = (
    'retries: AWS_MAX_ATTEMPTS (botocore), timeouts: FSSPEC_S3=\'{"config_kwargs": {"connect_timeout": S, '
    '"read_timeout": S}}\' (docs/data.md, "When the store fails")'
)


CONNECTIONS = 64  # data/index.py FOOTER_THREADS: the start-up's footer reads in flight


class StoreError(OSError):
    """The store did not give what was asked: no credentials, or no answer within the bound; names the URL."""


_FILESYSTEMS: dict[tuple[Any, ...], Any] = {}
_MAKING = threading.Lock()  # start-up reads footers on 64 threads: one filesystem made, not 64


def filesystem(url: str) -> tuple[Any, str]:
    """(filesystem, path without protocol) for a URL; on S3 a filesystem of the loader's own, whose retries are
    botocore's alone: one per protocol, process (a forked loader worker makes its own), fsspec S3 config and AWS_*
    environment (the endpoint and credentials its client was made with)."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol not in ("s3", "s3a") or "::" in url:
        return url_to_fs(url)
    user = fsspec.config.conf.get("s3", {})  # FSSPEC_S3, as fsspec applies it to s3fs
    key = (
        protocol,
        os.getpid(),
        repr(sorted(user.items())),
        *sorted(kv for kv in os.environ.items() if kv[0].startswith("AWS_")),
    )
    with _MAKING:
        if key not in _FILESYSTEMS:
            # Not fsspec's shared instance (whose retries stay as they are), and no listings cache: a listing kept from
            # start-up would hide a shard deleted or a folder changed since, by this process or another.
            # Connections: one per footer-reading thread of the start-up (botocore's default pool of 10 kept 54 of 64
            # waiting); the user's FSSPEC_S3 config_kwargs (timeouts, a pool size) are kept, not replaced.
            pool = {"max_pool_connections": CONNECTIONS, **user.get("config_kwargs", {})}
            fs, _ = url_to_fs(url, skip_instance_cache=True, use_listings_cache=False, config_kwargs=pool)
            fs.retries = 1  # s3fs's own retry loops (5 tries, nested) on top of botocore's: off
            _FILESYSTEMS[key] = fs
        fs = _FILESYSTEMS[key]
    return fs, fs._strip_protocol(url)


def server_failed(error: BaseException) -> bool:
    """Whether the store answered with a 5xx status (after botocore's attempts), which s3fs hands on as an
    OSError caused by botocore's ClientError."""
    for e in (error, error.__cause__):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) >= 500:
            return True
    return False


def is_store_failure(error: BaseException) -> bool:
    """Whether an error is the store's or the network's (credentials, connection, timeout, a 5xx answer), not
    the data's."""
    return isinstance(error, (StoreError, *CREDENTIAL_ERRORS, *TRANSIENT_ERRORS)) or server_failed(error)


def store_error(url: str, what: str, error: BaseException, reads: int, elapsed: float) -> StoreError:
    """The one-line error a user reads: the URL, what failed and why, and how to change the bound."""
    if isinstance(error, StoreError):
        return error
    if isinstance(error, CREDENTIAL_ERRORS):
        return StoreError(
            f"{url}: {what}: no credentials for the store ({type(error).__name__}: {error}); set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or ~/.aws/credentials"
        )
    tries = "once" if reads == 1 else f"{reads} times"
    attempts = os.environ.get("AWS_MAX_ATTEMPTS")
    each = f"{attempts} attempts (AWS_MAX_ATTEMPTS)" if attempts else "botocore's default attempts"
    return StoreError(
        f"{url}: {what}: the store failed (read {tries} in {elapsed:.1f} s, each request given {each}; last error "
        f"{type(error).__name__}: {error}); {BOUND_HINT}"
    )


def read_from_store(url: str, what: str, read: Callable[[], T]) -> T:
    """`read()`, read once more if the store cut its answer short; a store failure becomes a StoreError naming
    `url` and `what`, any other error (the data's) passes unchanged."""
    start = time.monotonic()
    for attempt in range(1, READS + 1):
        try:
            return read()
        except Exception as e:
            if not is_store_failure(e):
                raise
            retried = isinstance(e, (StoreError, *CREDENTIAL_ERRORS, *RETRIED_BY_BOTOCORE)) or server_failed(e)
            if attempt == READS or retried:
                raise store_error(url, what, e, attempt, time.monotonic() - start) from e
            logger.warning(f"[data] {url}: {what}: the answer was cut short ({type(e).__name__}: {e}); reading again")
    raise AssertionError("unreachable")
