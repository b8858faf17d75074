"""Real S3 servers for the tests (benchmarks/s3_store.py): moto's threaded server and SeaweedFS, which checks
request signatures and keeps folder entries as production stores do. Each is reached as a user reaches an
S3-compatible store, through `s3://` URLs with AWS_ENDPOINT_URL and credentials in the environment (which the jobs
the tests launch inherit). A test parametrized over SERVERS runs its body once against each."""

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import s3fs

from benchmarks.s3_store import SERVERS, endpoint, environment

__all__ = ["SERVERS", "s3_server"]


@contextmanager
def s3_server(server: str) -> Iterator[s3fs.S3FileSystem]:
    """The named server running, empty, and the environment pointing at it; an s3fs client of it.

    fsspec keeps one s3fs instance per storage options, not per endpoint: the loader's `s3://` URLs in this test
    process would reach an earlier server's endpoint through it, so the cache is emptied on the way in and out."""
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        with endpoint(server) as url, pytest.MonkeyPatch.context() as env:
            for key, value in environment(url).items():
                env.setenv(key, value)
            yield s3fs.S3FileSystem(skip_instance_cache=True)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
