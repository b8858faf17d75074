"""Loader throughput on CPU: tokens/s per rank over parquet shards of real text.

The shards are built from Python's standard-library sources (about 30 MB of
text, 8 shards); the tokenizer is the demo's. `make bench-data`.
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

REPO = Path(__file__).resolve().parents[1]


def stdlib_shards(out: Path, num_shards: int = 8) -> None:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    for i in range(num_shards):
        part = texts[i::num_shards]
        pq.write_table(
            pa.table({"text": part, "source": ["stdlib"] * len(part)}), out / f"{i:05d}.parquet", row_group_size=256
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    args = parser.parse_args()
    encode = Encoder(HuggingFaceTokenizer(str(REPO / "assets" / "tiny")))
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
