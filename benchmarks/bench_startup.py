"""Start-up of many ranks over a corpus on a slow filesystem: every rank reading every footer vs. an index.

Method. A simulated fsspec filesystem (`slowfs://`, an in-memory store) sleeps a fixed latency on every
request and counts them: a listing (ls), a metadata look-up (info, isdir, exists), an open (a HEAD on an
object store) and every read of an open file (a ranged GET; pyarrow reads a small shard's footer in
one). It holds `--shards` small parquet shards of two row groups and their `_index.json`. Threads stand
for ranks, all released at once; a rank is ready when it knows the usable shards. Modes:

  a. every rank lists the shards and reads every footer (`data.shards.check_shards`, 16 threads per
     rank: the loader's start-up before the index). Simulated with `--ranks-a` ranks (default 8): every rank makes
     the same requests, so the count is scaled to `--ranks` exactly, and with an unthrottled store the
     ranks do not slow each other, so the wall time is what each of `--ranks` real ranks would wait;
     with `--max-rps` (shared by all ranks) every rank is simulated;
  b. rank 0 lists and reads the footers (`data.index.shard_infos` without an index, 64 threads) and
     shares the answer (`share_from_rank0` over an in-process channel); the other ranks wait for it;
  c. every rank lists the shards and reads the index (`shard_infos`: one listing, one index file);
  d. rank 0 lists and reads the index and shares it (`data.index.startup_shards`: the loader now).

Wall time runs from the release to the last rank ready; requests are those the filesystem served. Every
rank of every mode must find the same shards, or the benchmark fails. The simulated ranks share this
machine's cores, which real ranks do not: the footer parsing of all ranks is serialised here, so mode
a's wall time is an upper bound when it is CPU-bound (`--one-rank` also times a single rank of mode a
alone). The store has no rate limit unless
`--max-rps` is set; real object stores throttle at a few thousand requests per second per prefix,
which mode a's request count runs into first.

`--s3` times the same start-up against a real S3 server instead: `--shards` small shards put on moto's server on
127.0.0.1 (benchmarks/s3_store.py; the dev extra), once with the `_index.json` that data.prepare writes and once
without, read through a proxy holding each request for the latency (benchmarks/s3_proxy.py) at each of
`--s3-latency-ms`. Each start-up is one job's: rank 0's `data.index.startup_shards` (what the loader's
`source_infos` runs) in a fresh process pointed at the proxy by AWS_ENDPOINT_URL, with s3fs's default options; the
other ranks only wait for its broadcast. Every start-up must find the same shards, row groups and footer digests.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.memory import MemoryFileSystem

from benchmarks import s3_store
from benchmarks.isolated import forkserver, isolated
from benchmarks.s3_proxy import S3Proxy
from data.index import (
    INDEX_NAME,
    infos_from_json,
    infos_to_json,
    shard_infos,
    share_from_rank0,
    startup_shards,
    write_index,
)
from data.shards import check_shards, list_shards

PROTOCOL = "slowfs"
CORPUS = f"{PROTOCOL}:///corpus"
S3_ROOT = "s3://startup"  # --s3: the shards with their index in indexed/, without in bare/


class SlowFileSystem(MemoryFileSystem):
    """An in-memory filesystem where every request costs `latency` seconds (and at most `max_rps` run per second)."""

    protocol = PROTOCOL
    store: dict = {}  # not MemoryFileSystem's shared store
    pseudo_dirs = [""]
    latency = 0.0
    max_rps = 0.0
    requests = 0
    _lock = threading.Lock()
    _next_slot = 0.0

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return MemoryFileSystem._strip_protocol(str(path).removeprefix(f"{PROTOCOL}://"))

    @classmethod
    def request(cls) -> None:
        with cls._lock:
            cls.requests += 1
            wait = 0.0
            if cls.max_rps:
                now = time.monotonic()
                slot = max(now, cls._next_slot)
                cls._next_slot = slot + 1.0 / cls.max_rps
                wait = slot - now
        if wait + cls.latency > 0:
            time.sleep(wait + cls.latency)

    def ls(self, path, detail=True, **kwargs):
        self.request()
        return super().ls(path, detail=detail, **kwargs)

    def info(self, path, **kwargs):
        self.request()
        return super().info(path, **kwargs)

    def cat_file(self, path, start=None, end=None, **kwargs):  # one GET, as on S3 (an open is a HEAD, then GETs)
        self.request()
        return super().cat_file(path, start=start, end=end, **kwargs)

    def _open(self, path, mode="rb", **kwargs):
        if mode != "rb":
            return super()._open(path, mode, **kwargs)
        self.request()
        path = self._strip_protocol(path)
        if path not in self.store:
            raise FileNotFoundError(path)
        return _SlowFile(self.store[path].getvalue())  # a file of its own: readers do not share a position


class _SlowFile(io.BytesIO):
    def read(self, size=-1):
        SlowFileSystem.request()
        return super().read(size)

    def readinto(self, buffer):
        SlowFileSystem.request()
        return super().readinto(buffer)


class _Shared:
    def __init__(self) -> None:
        self.ready = threading.Event()
        self.data = b""


class ThreadChannel:
    """`data.index.Channel` between threads: rank 0's bytes reach the others through an event."""

    def __init__(self, shared: _Shared, rank: int):
        self.shared, self.rank = shared, rank

    def broadcast(self, data: bytes | None) -> bytes:
        if self.rank == 0:
            self.shared.data = data or b""
            self.shared.ready.set()
            return self.shared.data
        self.shared.ready.wait()
        return self.shared.data


def shard_bytes(i: int) -> bytes:
    """Shard i: a small parquet file of two row groups (sizes differ by shard)."""
    n = 2 + i % 7
    table = pa.table({"text": [f"document {i}.{j}" for j in range(2 * n)], "source": ["web"] * (2 * n)})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=n)
    return sink.getvalue().to_pybytes()


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.parquet"


def build_corpus(shards: int) -> None:
    """`shards` parquet files and their index, without latency."""
    SlowFileSystem.store.clear()
    fs = fsspec.filesystem(PROTOCOL)
    for i in range(shards):
        fs.pipe_file(f"/corpus/{shard_name(i)}", shard_bytes(i))
    write_index(list_shards([CORPUS]), f"{CORPUS}/{INDEX_NAME}")


def mode_a(rank: int, channel: ThreadChannel) -> list[str]:
    return check_shards(list_shards([CORPUS]), "text", "source", "error")


def mode_b(rank: int, channel: ThreadChannel) -> list[str]:
    def compute() -> dict:
        return infos_to_json(shard_infos(list_shards([CORPUS]), "text", "source", "error", index=None))

    return list(infos_from_json(share_from_rank0(compute, channel)))


def mode_c(rank: int, channel: ThreadChannel) -> list[str]:
    return list(shard_infos(list_shards([CORPUS]), "text", "source", "error"))


def mode_d(rank: int, channel: ThreadChannel) -> list[str]:
    return list(startup_shards([CORPUS], "", "text", "source", "error", channel=channel))


MODES: dict[str, tuple[str, Callable[[int, ThreadChannel], list[str]]]] = {
    "a": ("every rank reads every footer (check_shards, the loader before the index)", mode_a),
    "b": ("rank 0 reads the footers, shares", mode_b),
    "c": ("every rank reads the index", mode_c),
    "d": ("rank 0 reads the index, shares", mode_d),
}


def simulate(mode: str, ranks: int) -> tuple[float, int, list[list[str]]]:
    """(seconds until every rank is ready, requests served, each rank's shards) of one mode."""
    run = MODES[mode][1]
    shared = _Shared()
    start = threading.Barrier(ranks + 1)
    results: list[list[str]] = [[] for _ in range(ranks)]
    errors: list[BaseException] = []
    finished = [0.0] * ranks

    def rank(r: int) -> None:
        start.wait()
        try:
            results[r] = run(r, ThreadChannel(shared, r))
        except BaseException as e:
            errors.append(e)
            shared.ready.set()
        finished[r] = time.monotonic()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    SlowFileSystem.requests = 0
    start.wait()
    began = time.monotonic()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"mode {mode}: a rank failed") from errors[0]
    return max(finished) - began, SlowFileSystem.requests, results


def on_s3(endpoint: str, url: str) -> tuple[float, str]:
    """(seconds, digest of the answer): a job's start-up with `[data] paths = [url]` (`startup_shards`, as the
    loader's `source_infos` calls it: rank 0 lists the shards and reads the index or the footers) through the S3
    endpoint, run in a fresh process."""
    s3_store.use_endpoint(endpoint)
    start = time.perf_counter()
    infos = startup_shards([url], "", "text", "", "error")
    wall = time.perf_counter() - start
    found = sorted((path.rsplit("/", 1)[1], info.row_groups, info.size, info.footer) for path, info in infos.items())
    return wall, hashlib.blake2b(json.dumps(found).encode(), digest_size=16).hexdigest()


def s3_bench(args: argparse.Namespace) -> None:
    """The shards (and, in one folder, their index) on moto's S3 server; start-up timed at each latency."""
    s3_store.require("--s3")
    ctx = forkserver(["data.index", "s3fs"])
    with tempfile.TemporaryDirectory() as tmp, s3_store.moto_endpoint() as endpoint, S3Proxy(endpoint) as proxy:
        files = {shard_name(i): Path(tmp) / shard_name(i) for i in range(args.shards)}
        for i, path in enumerate(files.values()):
            path.write_bytes(shard_bytes(i))
        write_index(list_shards([tmp]), f"{tmp}/{INDEX_NAME}")  # as data.prepare leaves it beside the shards
        began = time.perf_counter()
        s3_store.upload(endpoint, {**files, INDEX_NAME: Path(tmp) / INDEX_NAME}, f"{S3_ROOT}/indexed")
        s3_store.upload(endpoint, files, f"{S3_ROOT}/bare")
        upload_s = time.perf_counter() - began
        print(
            f"{args.shards} shards on moto's S3 server on 127.0.0.1 (uploaded twice in {upload_s:.0f} s), "
            f"read through a proxy holding each request for the latency; one job's start-up (rank 0; its answer is "
            f"then broadcast), each in a fresh process, on {os.cpu_count()} CPU cores"
        )
        print("| latency ms a request | shard index | start-up s | requests |")
        print("|---|---|---|---|")
        found = set()
        for latency in args.s3_latency_ms:
            for folder, index in (("indexed", "_index.json"), ("bare", "none: every footer read")):
                proxy.latency_s, before = latency / 1e3, proxy.requests
                wall, digest = isolated(ctx, on_s3, proxy.url, f"{S3_ROOT}/{folder}")
                found.add(digest)
                print(f"| {latency:g} | {index} | {wall:.2f} | {proxy.requests - before:,} |")
    if len(found) != 1:
        raise SystemExit("start-up found other shards, row groups or footers with the index than without")
    print(f"every start-up found the same {args.shards} shards, row groups and footer digests")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=2048, help="shards in the simulated corpus")
    parser.add_argument("--ranks", type=int, default=64, help="ranks starting at once (threads)")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="seconds per request, in ms")
    parser.add_argument("--max-rps", type=float, default=0.0, help="requests per second the store serves (0: any)")
    parser.add_argument("--ranks-a", type=int, default=8, help="ranks simulated in mode a (see above)")
    parser.add_argument("--modes", default="abcd", help="which modes to run (letters of a, b, c, d)")
    parser.add_argument("--one-rank", action="store_true", help="also time one rank of mode a alone")
    parser.add_argument("--quick", action="store_true", help="64 shards, 4 ranks, 5 ms: a test of the plumbing")
    parser.add_argument("--s3", action="store_true", help="a real S3 server instead (the dev extra; see above)")
    parser.add_argument(
        "--s3-latency-ms",
        type=lambda text: [float(t) for t in text.split(",") if t],
        default=[0.0, 20.0, 100.0],
        help="with --s3: per request, each a row (default 0,20,100)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.shards, args.ranks, args.latency_ms = 64, 4, 5.0
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.s3:
        s3_bench(args)
        return
    fsspec.register_implementation(PROTOCOL, SlowFileSystem, clobber=True)
    SlowFileSystem.latency, SlowFileSystem.max_rps = 0.0, 0.0
    build_corpus(args.shards)
    SlowFileSystem.latency, SlowFileSystem.max_rps = args.latency_ms / 1e3, args.max_rps
    limit = f", at most {args.max_rps:g} requests/s" if args.max_rps else ", no rate limit"
    print(
        f"{args.shards} shards, {args.ranks} ranks (threads on {os.cpu_count()} CPU cores), "
        f"{args.latency_ms:g} ms per request{limit}"
    )
    print("| mode | what each rank does | wall s, all ranks ready | requests | requests per rank |")
    print("|---|---|---|---|---|")
    found: set[tuple[str, ...]] = set()
    for mode in args.modes:
        ranks = min(args.ranks, args.ranks_a) if mode == "a" and not args.max_rps else args.ranks
        wall, requests, results = simulate(mode, ranks)
        found.update(tuple(sorted(r)) for r in results)
        what = MODES[mode][0]
        if ranks != args.ranks:
            what += f"; {ranks} ranks simulated, requests scaled to {args.ranks}"
            requests = requests * args.ranks // ranks
        print(f"| {mode} | {what} | {wall:.2f} | {requests:,} | {requests / args.ranks:,.1f} |")
    if args.one_rank and "a" in args.modes:
        wall, requests, results = simulate("a", 1)
        print(f"| a, 1 rank | {MODES['a'][0]}, one rank alone | {wall:.2f} | {requests:,} | {requests:,} |")
    if len(found) != 1 or len(next(iter(found))) != args.shards:
        raise SystemExit(f"ranks disagree on the shards, or miss some: {sorted(len(f) for f in found)}")
    print(f"every rank of every mode found the same {args.shards} shards")


if __name__ == "__main__":
    main()
