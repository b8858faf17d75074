"""Loader throughput on CPU: tokens/s per rank over parquet shards of real text.

The shards are built from Python's standard-library sources (about 30 MB of
text, 8 shards); the tokenizer is the demo's. `make bench-data`.

`--long-doc-mb 20` instead measures what one long document costs the batches after it:
two streams, one reading ordinary documents and one a single document of that size;
per-batch times side by side (the long stream's first batch, which tokenises it, left
out) and the size of each stream's checkpointed state.
"""

from __future__ import annotations

import argparse
import sysconfig
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from data.config import DataConfig
from data.loader import Encoder, ParquetDataLoader
from data.shards import list_shards
from data.stream import epoch_streams

REPO = Path(__file__).resolve().parents[1]


def stdlib_shards(out: Path, num_shards: int = 8) -> None:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    for i in range(num_shards):
        part = texts[i::num_shards]
        pq.write_table(
            pa.table({"text": part, "source": ["stdlib"] * len(part)}), out / f"{i:05d}.parquet", row_group_size=256
        )


def long_doc_shards(out: Path, megabytes: float) -> None:
    """ordinary.parquet: every stdlib source file; long.parquet: one document of their text, `megabytes` long."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    pq.write_table(pa.table({"text": texts, "source": ["ordinary"] * len(texts)}), out / "ordinary.parquet")
    size, long = int(megabytes * 1e6), ""
    while len(long) < size:
        long += "".join(texts)
    pq.write_table(pa.table({"text": [long[:size]], "source": ["long"]}), out / "long.parquet")


def long_doc_bench(args: argparse.Namespace, encode: Encoder) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        long_doc_shards(Path(tmp), args.long_doc_mb)
        cfg = DataConfig(paths=[tmp], num_streams=2, source_column="source")
        shards = list_shards(cfg.paths)
        long_stream = next(
            s for s, mine in enumerate(epoch_streams(shards, cfg.seed, 0, 2)) if mine[0].endswith("long.parquet")
        )
        loader = ParquetDataLoader(cfg, shards, encode, args.seq_len, args.batch, 0, 1, 0)
        it = iter(loader)
        times: dict[int, list[float]] = {0: [], 1: []}
        for k in range(2 * (args.batches + 1)):
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
        f"| {args.batches} | {mean[ordinary]:.2f} | {mean[long_stream]:.2f} | {mean[long_stream] / mean[ordinary]:.2f} "
        f"| {size[ordinary]:,}, {size[long_stream]:,} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--long-doc-mb", type=float, default=0.0, help="measure one long document instead")
    args = parser.parse_args()
    encode = Encoder(HuggingFaceTokenizer(str(REPO / "assets" / "tiny")))
    if args.long_doc_mb:
        long_doc_bench(args, encode)
        return
    with tempfile.TemporaryDirectory() as tmp:
        stdlib_shards(Path(tmp))
        cfg = DataConfig(paths=[tmp], num_streams=8, source_column="source")
        shards = list_shards(cfg.paths)
        print(f"{len(shards)} shards of CPython stdlib sources, seq {args.seq_len}, batch {args.batch}")
        print("| loader workers | tokens/s per rank |")
        print("|---|---|")
        for workers in args.workers:
            loader = ParquetDataLoader(cfg, shards, encode, args.seq_len, args.batch, 0, 1, workers)
            it = iter(loader)
            for _ in range(4):  # warm-up: workers start, first row groups
                next(it)
            start = time.perf_counter()
            for _ in range(args.batches):
                next(it)
            rate = args.batches * args.batch * args.seq_len / (time.perf_counter() - start)
            print(f"| {workers} | {rate:,.0f} |")


if __name__ == "__main__":
    main()
