"""Loader throughput on CPU: tokens/s per rank, per tokenizer and number of loader workers.

By default the shards are built from CPython's standard-library sources (about 30 MB of
text, 8 shards, site-packages left out) and two tokenizers are measured: the demo's (2,048
ids) and a 128,256-id byte-level BPE of Llama-3's shape trained on this machine's text
(benchmarks/bpe128k.py, cached after the first run), so the table shows what the real
vocabulary costs. `make bench-data`; `--tokenizer DIR` (a tokenizer.json folder, such as a
checkpoint's) and `--shards GLOB_OR_DIR` measure others.

A stream tokenises a chunk of documents (up to [data] tokenize_batch, within a row group) when
its read-ahead runs out, then serves windows from it for many batches, so a short run measures
either those bursts or none of them. The clock starts after one batch from every stream (each
has read its first chunk) and, unless `--batches` says otherwise, runs for about eight chunks
of every stream: the sustained rate, a few percent high (the window starts with every chunk
full and ends partway through one). The generated shards have 64-row row groups, so a chunk is
about 1 MB of text, as 256 web documents are.

Each measurement runs in a fresh process, as a training rank starts: nothing has been
tokenised before its loader workers fork (HF tokenizers turns its thread pool off in forked
workers when the parent used it), and no cache of an earlier run is warm.

`--store local,s3 --latency-ms 0,20,100` adds the same measurement from object storage: the shards put on
moto's S3 server on 127.0.0.1 (benchmarks/s3_store.py, the dev extra), read through a proxy that holds every
request for the latency (benchmarks/s3_proxy.py), the measuring process pointed at it by AWS_ENDPOINT_URL as a
job would be; each row beside the local one, with its ratio, the longest wait for one batch (a chunk's reads and
tokenising, where no worker reads ahead) and the requests the store served. Every S3 row must deliver the local
row's tokens (a digest of the batches outside the clock), or the benchmark fails.

`--long-doc-mb 20` instead measures what one long document costs the batches after it:
two streams, one reading ordinary documents and one a single document of that size;
per-batch times side by side (the long stream's first batch, which tokenises it, left
out) and the size of each stream's checkpointed state.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import multiprocessing
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from benchmarks import s3_store
from benchmarks.bpe128k import CACHE, Recipe, cached_bpe, library_roots
from benchmarks.isolated import forkserver, isolated
from benchmarks.s3_proxy import S3Proxy
from data.config import DataConfig
from data.loader import Encoder, ParquetDataLoader, source_infos
from data.shards import ShardInfo, list_shards, read_row_group, shard_info
from data.stream import epoch_streams, shard_keys

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "assets" / "tiny"
MOST_STREAMS = 8
ROUNDS = 8  # read-ahead chunks of every stream in the timed window, by default
SAMPLE_MB = 4.0  # text tokenised for the bytes-per-token column
# What each measurement's process starts from: imported once, in the forkserver.
PRELOAD = ["torch", "pyarrow.parquet", "torchtitan.components.tokenizer", "data.loader"]
BUCKET = "s3://bench/corpus"  # where --store s3 puts the shards


def make_loader(
    cfg: DataConfig,
    shards: list[str] | dict[str, list[str]],
    encode: Encoder,
    seq_len: int,
    batch: int,
    workers: int,
    infos: dict[str, ShardInfo] | None = None,
) -> ParquetDataLoader:
    """The bench's one loader construction (rank 0 of 1), kept apart so a new constructor is one edit."""
    return ParquetDataLoader(
        cfg, shards, encode, seq_len=seq_len, batch=batch, dp_rank=0, dp_world=1, num_workers=workers, infos=infos
    )


def stdlib_texts() -> list[str]:
    """Every .py file of the standard library proper (its site-packages left out), in path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.rglob("*.py") if "site-packages" not in f.relative_to(root).parts)
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def stdlib_shards(out: Path, num_shards: int = 8, row_group_size: int = 64) -> None:
    texts = stdlib_texts()
    for i in range(num_shards):
        part = texts[i::num_shards]
        table = pa.table({"text": part, "source": ["stdlib"] * len(part)})
        pq.write_table(table, out / f"{i:05d}.parquet", row_group_size=row_group_size)


def long_doc_shards(out: Path, megabytes: float) -> None:
    """ordinary.parquet: every stdlib source file; long.parquet: one document of their text, `megabytes` long."""
    texts = stdlib_texts()
    pq.write_table(pa.table({"text": texts, "source": ["ordinary"] * len(texts)}), out / "ordinary.parquet")
    size, long = int(megabytes * 1e6), ""
    while len(long) < size:
        long += "".join(texts)
    pq.write_table(pa.table({"text": [long[:size]], "source": ["long"]}), out / "long.parquet")


def stream_count(num_shards: int, workers: list[int]) -> int:
    """Streams for the run: at most 8 and the shard count, a multiple of every worker count."""
    step = math.lcm(*(w for w in workers if w)) if any(workers) else 1
    streams = min(MOST_STREAMS, num_shards) // step * step
    if not streams:
        raise ValueError(f"{num_shards} shards cannot give each of {step} loader workers a stream")
    return streams


def text_sample(cfg: DataConfig, shards: list[str], megabytes: float) -> list[str]:
    """The shards' first documents, row group by row group, until `megabytes` of UTF-8."""
    texts: list[str] = []
    size = 0
    groups = ((path, rg) for path in shards for rg in range(len(shard_info(path, cfg.text_column).row_groups)))
    for path, rg in groups:
        if size >= megabytes * 1e6:
            break
        docs = [t for t in read_row_group(path, rg, cfg.text_column)[0] if t]
        texts += docs
        size += sum(len(t.encode("utf-8")) for t in docs)
    return texts


def tokenizer_stats(tokenizer: str, cfg: DataConfig, shards: list[str]) -> tuple[int, float, float]:
    """(vocab size, UTF-8 bytes per token, tokens per document) over a sample, the text's tokens alone
    (no bos or eos, whatever the loader adds)."""
    tok = HuggingFaceTokenizer(tokenizer)
    texts = text_sample(cfg, shards, SAMPLE_MB)
    encoded = tok.tokenizer.encode_batch(texts, add_special_tokens=False)
    tokens = max(1, sum(len(e.ids) for e in encoded))
    return tok.get_vocab_size(), sum(len(t.encode("utf-8")) for t in texts) / tokens, tokens / max(1, len(texts))


def sustained_batches(cfg: DataConfig, shards: list[str], tokens_per_doc: float, batch: int, seq_len: int) -> int:
    """Batches that take about ROUNDS read-ahead chunks from every stream: a chunk is tokenize_batch
    documents or the rest of a row group, whichever is fewer."""
    rows = [n for path in shards for n in shard_info(path, cfg.text_column).row_groups]
    docs = min(cfg.tokenize_batch, sum(rows) / len(rows))
    return math.ceil(ROUNDS * cfg.num_streams * docs * tokens_per_doc / (batch * seq_len))


class Measured(NamedTuple):
    tokens_per_s: float
    longest_wait_s: float  # the longest one batch took to come, in the timed window
    digest: str  # of the batches before the clock and the last one: which tokens were read


@dataclass
class Remote:
    """The shards on the S3 server, behind the proxy that adds each row's latency."""

    proxy: S3Proxy
    cfg: DataConfig  # the run's config with the shards' s3:// URLs


def tokens_per_second(
    endpoint: str, tokenizer: str, cfg: DataConfig, seq_len: int, batch: int, batches: int, workers: int
) -> Measured:
    """One tokenizer and worker count, timed after one batch from every stream; run in a fresh process.

    The shards are listed and checked as a job's start-up does (`source_infos`); `endpoint`: the S3 endpoint this
    process and its loader workers reach (AWS_ENDPOINT_URL), "" for none."""
    if endpoint:
        s3_store.use_endpoint(endpoint)
    shards, infos = source_infos(cfg)
    loader = make_loader(cfg, shards, Encoder(HuggingFaceTokenizer(tokenizer)), seq_len, batch, workers, infos)
    it, digest = iter(loader), hashlib.blake2b(digest_size=16)
    for _ in range(cfg.num_streams):
        digest.update(next(it)[0]["input"].numpy().tobytes())
    longest, start = 0.0, time.perf_counter()
    for _ in range(batches):
        began = time.perf_counter()
        last = next(it)
        longest = max(longest, time.perf_counter() - began)
    rate = batches * batch * seq_len / (time.perf_counter() - start)
    it.close()  # stops the loader workers now
    digest.update(last[0]["input"].numpy().tobytes())
    return Measured(rate, longest, digest.hexdigest())


HEADER = [
    "| tokenizer | vocab | loader workers | timed batches | tokens/s per rank | bytes of text per token |",
    "|---|---|---|---|---|---|",
]
HEADER_STORES = [
    "| tokenizer | vocab | loader workers | timed batches | store | latency ms a request | tokens/s per rank "
    "| x local | longest wait for a batch, ms | requests | bytes of text per token |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
]


def store_rows(
    ctx: BaseContext, path: str, cfg: DataConfig, args: argparse.Namespace, batches: int, workers: int, remote: Remote
) -> list[tuple[str, str, Measured, int | None]]:
    """(store, latency, measurement, requests) for local (if asked) and S3 at each latency, each in its own process;
    S3 must deliver the local tokens."""
    run = (path, cfg, args.seq_len, args.batch, batches, workers)
    local = isolated(ctx, tokens_per_second, "", *run) if "local" in args.store else None
    rows = [("local", "-", local, None)] if local else []
    for latency in args.latency_ms:
        remote.proxy.latency_s, before = latency / 1e3, remote.proxy.requests
        got = isolated(ctx, tokens_per_second, remote.proxy.url, path, remote.cfg, *run[2:])
        if local and got.digest != local.digest:
            raise SystemExit(f"S3 at {latency:g} ms delivered other tokens than the same shards on disk")
        rows.append(("s3", f"{latency:g}", got, remote.proxy.requests - before))
    return rows


def throughput_table(
    tokenizers: dict[str, str], cfg: DataConfig, shards: list[str], args: argparse.Namespace, remote: Remote | None
) -> list[str]:
    """The markdown table, one row per tokenizer x worker count (x store and latency with `remote`), each
    measured in its own process."""
    ctx = forkserver(PRELOAD)
    rows = list(HEADER_STORES if remote else HEADER)
    for name, path in tokenizers.items():
        vocab, ratio, per_doc = isolated(ctx, tokenizer_stats, path, cfg, shards)
        batches = args.batches or sustained_batches(cfg, shards, per_doc, args.batch, args.seq_len)
        for workers in args.workers:
            head = f"| {name} | {vocab:,} | {workers} | {batches:,} |"
            if remote is None:
                rate = isolated(ctx, tokens_per_second, "", path, cfg, args.seq_len, args.batch, batches, workers)
                rows.append(f"{head} {rate.tokens_per_s:,.0f} | {ratio:.2f} |")
                continue
            measured = store_rows(ctx, path, cfg, args, batches, workers, remote)
            local = measured[0][2].tokens_per_s if measured[0][0] == "local" else None
            for store, latency, got, requests in measured:
                versus = f"{got.tokens_per_s / local:.2f}" if local else "-"
                count = "-" if requests is None else f"{requests:,}"
                wait = f"{got.longest_wait_s * 1e3:,.0f}"
                rate = f"{got.tokens_per_s:,.0f}"
                rows.append(f"{head} {store} | {latency} | {rate} | {versus} | {wait} | {count} | {ratio:.2f} |")
    return rows


def long_doc_bench(args: argparse.Namespace, encode: Encoder) -> None:
    batches = args.batches or 40
    with tempfile.TemporaryDirectory() as tmp:
        long_doc_shards(Path(tmp), args.long_doc_mb)
        cfg = DataConfig(paths=[tmp], num_streams=2, source_column="source")
        shards = list_shards(cfg.paths)
        long_stream = next(
            s for s, mine in enumerate(epoch_streams(shards, cfg.seed, 0, 2)) if mine[0].endswith("long.parquet")
        )
        loader = make_loader(cfg, shards, encode, args.seq_len, args.batch, 0)
        it = iter(loader)
        times: dict[int, list[float]] = {0: [], 1: []}
        for k in range(2 * (batches + 1)):
            start = time.perf_counter()
            next(it)
            times[loader.local[k % 2]].append(time.perf_counter() - start)
        state = loader.state_dict()
        size = {s: len(state[f"stream_{s:05d}"]) for s in (0, 1)}
    ordinary = 1 - long_stream
    mean = {s: sum(t[1:]) / (len(t) - 1) * 1e3 for s, t in times.items()}
    print(
        f"one {args.long_doc_mb:g} MB document beside ordinary ones (CPython stdlib sources): 2 streams, "
        f"seq {args.seq_len}, batch {args.batch}, 0 loader workers; first batch of the long stream "
        f"(tokenising it): {times[long_stream][0]:.1f} s"
    )
    print("| batches per stream | ordinary ms/batch | after the long doc ms/batch | ratio | state bytes (ord., long) |")
    print("|---|---|---|---|---|")
    print(
        f"| {batches} | {mean[ordinary]:.2f} | {mean[long_stream]:.2f} | {mean[long_stream] / mean[ordinary]:.2f} "
        f"| {size[ordinary]:,}, {size[long_stream]:,} |"
    )


def tokenizer_dirs(args: argparse.Namespace) -> dict[str, str]:
    """Table name -> folder: the --tokenizer folders (default: the demo's), then the local BPE if asked."""
    dirs = [Path(d).resolve() for d in args.tokenizer or [DEMO]]
    found = {str(d.relative_to(REPO)) if d.is_relative_to(REPO) else d.name: str(d) for d in dirs}
    bpe = args.bpe128k if args.bpe128k is not None else not args.tokenizer and not args.long_doc_mb
    if bpe:
        recipe = Recipe(vocab_size=args.bpe_vocab, corpus_mb=args.bpe_corpus_mb, roots=library_roots())
        name = "bpe128k" if args.bpe_vocab == Recipe.vocab_size else f"bpe{args.bpe_vocab}"
        found[name] = str(cached_bpe(recipe, args.bpe_cache))
    return found


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokenizer", action="extend", nargs="+", metavar="DIR", help="tokenizer folders (default: assets/tiny)"
    )
    parser.add_argument(
        "--bpe128k",
        action=argparse.BooleanOptionalAction,
        help="also the local 128k BPE (default: on when no --tokenizer is given)",
    )
    parser.add_argument(
        "--shards",
        action="extend",
        nargs="+",
        metavar="GLOB_OR_DIR",
        help="parquet shards (default: the stdlib's sources)",
    )
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per window (default 4096)")
    parser.add_argument("--batch", type=int, default=2, help="windows per batch (default 2)")
    parser.add_argument(
        "--batches", type=int, default=0, help=f"timed (default: {ROUNDS} chunks a stream; 40 with --long-doc-mb)"
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="loader worker counts (default 0 2)")
    parser.add_argument("--bpe-vocab", type=int, default=Recipe.vocab_size, help="the local BPE's ids with specials")
    parser.add_argument("--bpe-corpus-mb", type=float, default=Recipe.corpus_mb, help="its training text")
    parser.add_argument("--bpe-cache", type=Path, default=CACHE, help="where trained BPEs are kept")
    parser.add_argument("--long-doc-mb", type=float, default=0.0, help="measure one long document instead")
    parser.add_argument(
        "--store", type=_names, default=["local"], help="local, s3 or local,s3: where the shards are read from"
    )
    parser.add_argument(
        "--latency-ms", type=_numbers, default=[0.0, 20.0, 100.0], help="per S3 request, each a row (default 0,20,100)"
    )
    args = parser.parse_args(argv)
    if set(args.store) - {"local", "s3"} or not args.store:
        parser.error(f"--store {','.join(args.store)}: local, s3 or both")
    return args


def _names(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def _numbers(text: str) -> list[float]:
    return [float(t) for t in text.split(",") if t]


@contextmanager
def s3_copy(cfg: DataConfig, shards: list[str], args: argparse.Namespace) -> Iterator[Remote | None]:
    """With `--store s3`: the shards put on a fresh S3 server, each at its path below their common folder (the
    order's key, so S3 is read in the local order), behind a latency proxy; else None."""
    if "s3" not in args.store:
        yield None
        return
    s3_store.require("--store s3")
    with s3_store.moto_endpoint() as endpoint, S3Proxy(endpoint) as proxy:
        urls = s3_store.upload(endpoint, {key: Path(path) for path, key in shard_keys(shards).items()}, BUCKET)
        yield Remote(proxy, DataConfig(paths=urls, num_streams=cfg.num_streams))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tokenizers = tokenizer_dirs(args)
    if args.long_doc_mb:
        long_doc_bench(args, Encoder(HuggingFaceTokenizer(next(iter(tokenizers.values())))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.shards:
            shards, what = list_shards(args.shards), ", ".join(args.shards)
        else:
            stdlib_shards(Path(tmp))
            shards, what = list_shards([tmp]), "CPython stdlib sources"
        streams = stream_count(len(shards), args.workers)
        cfg = DataConfig(paths=shards, num_streams=streams)
        print(
            f"{len(shards)} shards of {what}; {streams} streams, seq {args.seq_len}, batch {args.batch}, "
            f"timed after one batch from each stream; 1 rank on {multiprocessing.cpu_count()} CPUs"
        )
        with s3_copy(cfg, shards, args) as remote:
            if remote:
                print(f"S3: moto's server on 127.0.0.1, {BUCKET}, through a proxy holding each request for the latency")
            print("\n".join(throughput_table(tokenizers, cfg, shards, args, remote)))


if __name__ == "__main__":
    main()
