"""The one way to the store: bounded requests, errors that say what failed, listings of objects alone.

Bounds. Each request is tried `AWS_MAX_ATTEMPTS` times in all (`AWS_RETRY_MODE`, `~/.aws/config`; botocore's
default, legacy mode: 5 attempts), each attempt given s3fs's connect timeout (5 s) and read timeout (15 s), which
fsspec's `FSSPEC_S3` sets: `FSSPEC_S3='{"config_kwargs": {"connect_timeout": 5, "read_timeout": 15}}'`. The read
timeout bounds a silence while an answer comes, not a request whose body cannot be sent (a stopped server takes
the first bytes, then none: the put waits for ever), so each attempt is also bounded as a whole: connect + read
timeout + its body at `MHAR_STORE_MIN_MB_S` (1 MB/s unless set), then retried as botocore retries a read timeout.
s3fs adds retry loops of its own on top (5 tries, twice nested for a read), which multiply botocore's into minutes
of silence (a dropped connection: 250 requests over 195 s); the project's S3 filesystem turns them off. A
connection cut after the answer began (which botocore cannot retry, the request having succeeded) is read again
once, with a warning.

Errors. A store failure becomes a StoreError (an OSError: at start-up one line and exit 2) naming the URL, the
operation, the time and what the store said, classified: credentials missing or refused, permission denied, a
missing bucket, throttling, a server error, no answer within the bound. None is a bad shard: `on_bad_shard = "skip"`
never skips a shard because the store failed, only because the shard itself is unusable (or gone).

Listings. An object store's "folder" is a prefix; some servers (SeaweedFS) keep a `prefix/` entry, or entries for
emptied sub-folders, after their last object is deleted. `objects` lists objects only, so a prefix whose objects
are gone is empty; `remove_prefix` deletes those entries too.
"""

from __future__ import annotations

import asyncio
import http.client
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec.config
from fsspec.core import url_to_fs

try:  # aiohttp, aiobotocore and botocore come with s3fs (the `s3` extra); without them no S3 error can occur
    from aiobotocore.httpsession import AIOHTTPSession
    from aiohttp import ClientError as AiohttpError
    from botocore import exceptions as botocore_errors

    CLIENT_ERRORS: tuple[type[BaseException], ...] = (AiohttpError,)
except ImportError:
    botocore_errors, CLIENT_ERRORS, AIOHTTPSession = None, (), object


def _botocore(*names: str) -> tuple[type[BaseException], ...]:
    return tuple(getattr(botocore_errors, name) for name in names) if botocore_errors else ()


logger = logging.getLogger(__name__)

T = TypeVar("T")

CREDENTIAL_ERRORS = _botocore("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError")
# Failures of the request itself, which botocore retried AWS_MAX_ATTEMPTS times before raising them.
RETRIED_BY_BOTOCORE = _botocore("ConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError")
# What S3 servers answer (the error code of the body; a HEAD answer has none, only its status).
REFUSED_CREDENTIALS = {
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "TokenRefreshRequired",
    "AuthorizationHeaderMalformed", "RequestTimeTooSkewed", "InvalidSecurity", "AccessKeyDisabled",
}  # fmt: skip
DENIED = {"AccessDenied", "AllAccessDisabled", "AccountProblem"}
THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "TooManyRequests", "RequestLimitExceeded",
             "RequestThrottled", "ServiceUnavailable"}  # fmt: skip
REFUSED_CONDITION = {"PreconditionFailed", "ConditionalRequestConflict"}  # an exclusive create that lost
MIN_RATE_ENV = "MHAR_STORE_MIN_MB_S"
MIN_RATE_MB_S = 1.0  # the slowest a request body may go before its attempt is given up (MIN_RATE_ENV)
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
    f'"read_timeout": S}}}}\', {MIN_RATE_ENV} (docs/object-storage.md, "When the store fails")'
)


CONNECTIONS = 64  # data/index.py FOOTER_THREADS: the start-up's footer reads in flight


class StoreError(OSError):
    """The store did not do what was asked; names the URL, the operation and why. `kind` is one of KINDS."""

    def __init__(self, message: str, kind: str = "unreachable"):
        super().__init__(message)
        self.kind = kind


KINDS = ("credentials", "permission", "missing bucket", "throttled", "server", "unreachable", "settings")


def min_rate() -> float:
    """Bytes a second a request body may not go slower than, from MIN_RATE_ENV (MB/s)."""
    value = os.environ.get(MIN_RATE_ENV, "")
    try:
        rate = float(value) if value else MIN_RATE_MB_S
    except ValueError:
        raise ValueError(f"{MIN_RATE_ENV}={value!r}: not a number of MB/s") from None
    if not rate > 0:
        raise ValueError(f"{MIN_RATE_ENV}={value!r}: must be more than 0 MB/s")
    return rate * 1e6


class BoundedSession(AIOHTTPSession):  # type: ignore[misc,valid-type]
    """aiobotocore's HTTP session with each attempt bounded as a whole (connect + read timeout + body at the
    minimum rate): a server that stops taking a body otherwise holds the put for ever. The overrun is botocore's
    ReadTimeoutError, which botocore retries."""

    async def send(self, request: Any) -> Any:
        timeout = self._timeout
        body = int(request.headers.get("Content-Length", 0) or 0)
        bound = (timeout.sock_connect or 0) + (timeout.sock_read or 0) + body / min_rate()
        try:
            return await asyncio.wait_for(super().send(request), bound)
        except TimeoutError as e:
            raise botocore_errors.ReadTimeoutError(endpoint_url=request.url, error=f"no answer in {bound:.1f} s") from e


_FILESYSTEMS: dict[tuple[Any, ...], Any] = {}
_MAKING = threading.Lock()  # start-up reads footers on 64 threads: one filesystem made, not 64


def filesystem(url: str) -> tuple[Any, str]:
    """(filesystem, path without protocol) for a URL; on S3 the project's own, whose retries are botocore's alone
    and whose requests are bounded as a whole (BoundedSession): one per protocol, process (a forked loader worker
    makes its own), fsspec S3 config and AWS_* environment (the endpoint and credentials its client was made with)."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol not in ("s3", "s3a") or "::" in url:
        return url_to_fs(url)
    try:
        min_rate()  # a bad MHAR_STORE_MIN_MB_S named here, before any request, not inside one
    except ValueError as e:
        raise StoreError(f"{url}: {e}", "settings") from None
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
            pool = {
                "max_pool_connections": CONNECTIONS,
                "http_session_cls": BoundedSession,
                **user.get("config_kwargs", {}),
            }
            fs, _ = url_to_fs(url, skip_instance_cache=True, use_listings_cache=False, config_kwargs=pool)
            fs.retries = 1  # s3fs's own retry loops (5 tries, nested) on top of botocore's: off
            _FILESYSTEMS[key] = fs
        fs = _FILESYSTEMS[key]
    return fs, fs._strip_protocol(url)


def s3_answer(error: BaseException) -> tuple[int, str, str]:
    """(HTTP status, error code, operation) of the S3 answer behind an error (s3fs hands botocore's ClientError on
    as the cause of an OSError); (0, "", "") if none."""
    for e in (error, error.__cause__, error.__context__):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            code = str(response.get("Error", {}).get("Code", "") or "")
            code = "" if code.isdigit() else code  # botocore's stand-in for a HEAD answer's missing code: its status
            return status, code, str(getattr(e, "operation_name", "") or "")
    return 0, "", ""


def classify(error: BaseException) -> str | None:
    """Which of KINDS a failure is, or None where it is not the store's (the data's, a missing object)."""
    if isinstance(error, StoreError):
        return error.kind
    if isinstance(error, CREDENTIAL_ERRORS):
        return "credentials"
    status, code, operation = s3_answer(error)
    if code in REFUSED_CREDENTIALS:
        return "credentials"
    if code in DENIED or status == 403:
        return "permission"
    if code == "NoSuchBucket" or (status == 404 and operation == "HeadBucket"):
        return "missing bucket"
    if code in THROTTLED or status in (429, 503):
        return "throttled"
    if status >= 500:
        return "server"
    if isinstance(error, (*TRANSIENT_ERRORS, *RETRIED_BY_BOTOCORE)) or isinstance(error.__cause__, RETRIED_BY_BOTOCORE):
        return "unreachable"
    return None


def server_failed(error: BaseException) -> bool:
    """Whether the store answered with a 5xx status (after botocore's attempts)."""
    return s3_answer(error)[0] >= 500


def is_store_failure(error: BaseException) -> bool:
    """Whether an error is the store's or the network's (credentials, permissions, a missing bucket, throttling,
    a 5xx answer, no answer), not the data's."""
    return classify(error) is not None


def _said(error: BaseException) -> str:
    status, code, operation = s3_answer(error)
    if status:
        on = f" on {operation}" if operation else ""
        return f"HTTP {status}{' ' + code if code else ''}{on}: {error}"
    return f"{type(error).__name__}: {error}"


def store_error(url: str, what: str, error: BaseException, reads: int, elapsed: float) -> StoreError:
    """The one-line error a user reads: the URL, what failed and why, in the store's words and ours."""
    if isinstance(error, StoreError):
        return error
    kind = classify(error) or "unreachable"
    head = f"{url}: {what}"
    if isinstance(error, CREDENTIAL_ERRORS):
        return StoreError(
            f"{head}: no credentials for the store ({type(error).__name__}: {error}); set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or ~/.aws/credentials",
            kind,
        )
    said = _said(error)
    if kind == "credentials":
        return StoreError(
            f"{head}: the store refused the credentials ({said}); check AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and the clock",
            kind,
        )
    if kind == "permission":
        return StoreError(
            f"{head}: access denied ({said}); the credentials lack permission for it, or are wrong (an answer to "
            "a HEAD request carries no reason)",
            kind,
        )
    if kind == "missing bucket":
        bucket = url.removeprefix("s3://").removeprefix("s3a://").split("/")[0]
        return StoreError(f"{head}: the bucket {bucket!r} does not exist on this store ({said})", kind)
    tries = "once" if reads == 1 else f"{reads} times"
    attempts = os.environ.get("AWS_MAX_ATTEMPTS")
    each = f"{attempts} attempts (AWS_MAX_ATTEMPTS)" if attempts else "botocore's default attempts"
    why = "the store throttled the requests" if kind == "throttled" else "the store failed"
    return StoreError(
        f"{head}: {why} (read {tries} in {elapsed:.1f} s, each request given {each}; last error {said}); {BOUND_HINT}",
        kind,
    )


def store_call(url: str, what: str, call: Callable[[], T]) -> T:
    """`call()`, read once more if the store cut its answer short; a store failure becomes a StoreError naming
    `url` and `what`, any other error (the data's, a missing object) passes unchanged."""
    start = time.monotonic()
    for attempt in range(1, READS + 1):
        try:
            return call()
        except Exception as e:
            if not is_store_failure(e):
                raise
            cut_short = isinstance(e, TRANSIENT_ERRORS) and not isinstance(e, RETRIED_BY_BOTOCORE)
            if attempt == READS or not cut_short or s3_answer(e)[0]:
                said = _why_forbidden(url) or e if s3_answer(e)[:2] == (403, "") else e
                raise store_error(url, what, said, attempt, time.monotonic() - start) from e
            logger.warning(f"[data] {url}: {what}: the answer was cut short ({type(e).__name__}: {e}); reading again")
    raise AssertionError("unreachable")


def _why_forbidden(url: str) -> BaseException | None:
    """A 403 answer to a HEAD request carries no reason; the bucket's listing, asked once, says whether the
    credentials were refused or lack a permission. Its error, or None where it says nothing more."""
    try:
        fs, bare = filesystem(url)
        if hasattr(fs, "call_s3"):
            fs.call_s3("list_objects_v2", Bucket=bare.split("/")[0], MaxKeys=1)
    except Exception as e:  # noqa: BLE001  whatever the store answers is only a better reason, or none
        return e if s3_answer(e)[1] else None
    return None


# -- objects and prefixes ---------------------------------------------------------------------------------


def objects(fs: Any, root: str) -> list[str]:
    """Every object below `root` (bare path), as paths relative to it; folder entries (a `name/` key, an emptied
    sub-folder) are not objects. [] where nothing is there; a bucket that is not there is an error."""
    try:
        found = fs.find(root, withdirs=False, detail=True)
    except FileNotFoundError:
        found = {}
    if not found and hasattr(fs, "call_s3"):  # nothing there: a prefix of a bucket that exists, or no bucket at all
        fs.call_s3("head_bucket", Bucket=root.split("/")[0])
    prefix = root.rstrip("/") + "/"
    return sorted(
        name[len(prefix) :]
        for name, info in found.items()
        if info.get("type") == "file" and not name.endswith("/") and name.startswith(prefix)
    )


def _folder_entries(fs: Any, root: str) -> list[str]:
    """Folder entries at and below `root`, deepest first (S3 only)."""
    try:
        below = fs.ls(root, detail=True, refresh=True)
    except FileNotFoundError:
        return []
    entries = []
    for info in below:
        name = info["name"].rstrip("/")
        if info.get("type") == "directory" and name != root.rstrip("/"):
            entries += _folder_entries(fs, name)
    return [*entries, root.rstrip("/")]


def remove_prefix(fs: Any, root: str, names: list[str] | None = None) -> None:
    """Delete the objects `names` below `root` (all of them by default), then, on S3, the folder entries left
    empty: a prefix the project emptied lists nothing afterwards, on any server."""
    names = objects(fs, root) if names is None else names
    if names:
        fs.rm([f"{root}/{n}" for n in names])
    if not hasattr(fs, "call_s3"):
        return
    for entry in _folder_entries(fs, root):
        if objects(fs, entry):
            continue
        bucket, _, key = entry.partition("/")
        if key:
            fs.call_s3("delete_object", Bucket=bucket, Key=key + "/")
    fs.invalidate_cache()


def create_exclusive(fs: Any, path: str, data: bytes) -> None:
    """Create `path` holding `data` only if nothing is there (on S3 a conditional put, If-None-Match: *); another
    writer's object there is a FileExistsError, however the server words its refusal (412 PreconditionFailed,
    409 ConditionalRequestConflict)."""
    try:
        with fs.open(path, "xb") as f:
            f.write(data)
    except FileExistsError:
        raise
    except OSError as e:
        status, code, _ = s3_answer(e)
        if code in REFUSED_CONDITION or status in (409, 412):
            raise FileExistsError(f"{path}: created by another writer ({_said(e)})") from e
        raise
