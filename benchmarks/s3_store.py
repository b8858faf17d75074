"""A real S3 store on this machine for the benchmarks and the tests: moto's threaded server on a free port of
127.0.0.1, started empty, reached as a user reaches an S3-compatible store (`s3://` URLs, AWS_ENDPOINT_URL and
credentials in the environment; benchmarks/s3_proxy.py in between adds latency).

moto and s3fs come with the dev extra; without them this module still imports, and `require` says what to install.
"""

from __future__ import annotations

import logging
import os
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

try:  # the optional dev extra (pip install -e '.[dev]'): moto's server and s3fs
    import s3fs
    from moto import server as moto_server
except ImportError:  # `require` refuses with the install line; the rest of the benchmarks import without them
    s3fs = moto_server = None

EXTRA = "needs moto's S3 server and s3fs: pip install -e '.[dev]'"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


def require(what: str) -> None:
    """Stop with one line naming the extra when moto or s3fs is missing."""
    if moto_server is None or s3fs is None:
        raise SystemExit(f"{what} {EXTRA}")


@contextmanager
def moto_endpoint() -> Iterator[str]:
    """moto's server running and empty; its URL (http://127.0.0.1:PORT)."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # not a line per request on the benchmark's output
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        # moto keeps its buckets in the process, not in the server: a server started after another in the same
        # process would see the first one's buckets. Its reset API empties them.
        urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"), timeout=30)
        yield url
    finally:
        server.stop()


def environment(endpoint: str) -> dict[str, str]:
    """What a job's environment holds to reach the store at `endpoint` through fsspec's default options."""
    return {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}


def use_endpoint(endpoint: str) -> None:
    """Point this process (and the loader workers it starts) at `endpoint`, as a job's environment would."""
    os.environ.update(environment(endpoint))


def client(endpoint: str) -> s3fs.S3FileSystem:
    """An s3fs client of `endpoint` that shares no cached instance or listing with the loader's."""
    return s3fs.S3FileSystem(
        endpoint_url=endpoint,
        key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        secret=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        skip_instance_cache=True,
    )


def upload(endpoint: str, files: dict[str, Path], url: str) -> list[str]:
    """Each file put at its key (a path below the folder `url`, s3://bucket/prefix; the bucket made if new); their
    URLs, in the order given."""
    fs = client(endpoint)
    bucket = url.removeprefix("s3://").split("/")[0]
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    urls = [f"{url.rstrip('/')}/{key}" for key in files]
    fs.put([str(f) for f in files.values()], urls)
    return urls
