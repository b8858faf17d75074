"""A real S3 server for the tests: moto's threaded server on a free port of 127.0.0.1, reached as a user reaches an
S3-compatible store, through `s3://` URLs with AWS_ENDPOINT_URL and credentials in the environment (which the
jobs the tests launch inherit)."""

import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import s3fs
from moto import server as moto_server

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


@contextmanager
def s3_server() -> Iterator[s3fs.S3FileSystem]:
    """The server running, empty, and the environment pointing at it; an s3fs client of it."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    # moto keeps its buckets in the process, not in the server: a server started after another in the same test
    # process would see the first one's buckets. Its reset API empties them.
    urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST"), timeout=30)
    try:
        with pytest.MonkeyPatch.context() as env:
            for key, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": f"http://{host}:{port}"}.items():
                env.setenv(key, value)
            yield s3fs.S3FileSystem(skip_instance_cache=True)
    finally:
        server.stop()
