"""Convert raw text into the loader's parquet shards: `python -m data.prepare OUT_DIR INPUT [INPUT ...]`.

Inputs (data.readers): JSON lines (.jsonl, .ndjson; plain, .gz or .zst), text files (.txt, same
compressions; a document per file by default, since splitting a book into lines would put an
end-of-text token between its paragraphs), parquet, Arrow IPC and folders written by
`datasets.save_to_disk`. Documents keep the input order (arguments in order, a folder's files in
sorted path order) and are written to `OUT_DIR/shard-00000.parquet`, ... with the columns `text` and
`source` (`--source`, by default each input argument's name without its suffixes), zstd-compressed,
in row groups of `--row-group-docs` documents (or 128 MiB of text, whichever comes first; the
loader shuffles within a row group and reads one at a time). The same inputs and options give
byte-identical shards, index and summary.

Beside the shards: `manifest.txt` (their absolute paths, for `[data] manifest`), `_index.json`
(data.index: start-up reads it instead of every footer) and `summary.json` (also printed): documents,
bytes of text and estimated tokens per source, shards, row groups, and the rows not written, per
input file and reason with their first locations. Bad rows (invalid JSON, not an object, missing or
non-string text, invalid UTF-8) fail the run when more than `--max-bad-fraction` of all rows read;
empty documents and blank lines are counted, never bad. The output is built in a hidden folder
beside OUT_DIR (`.NAME.partial-PID@HOST`) and renamed into place when complete, so an interrupted run
leaves no partial shard under OUT_DIR; the next run to the same OUT_DIR removes such folders left by
processes of this host that are gone (a killed run) and mentions those of another host. OUT_DIR may be a
prefix on object storage (`s3://bucket/corpus`), which has no rename: data/prepare_output.py says how it
is written there instead.
Memory: one row group of documents, plus the token sample (a few MB per source).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from data.atomic import OutputError, RemoteFolder, sibling
from data.index import INDEX_NAME, index_text, write_index
from data.prepare_output import (
    PrepareError,
    check_out_dir,
    clean_stale,
    clear_old,
    commit,
    is_url,
    out_dir,
    remote_output,
    say,
)
from data.prepare_report import FileStats, Sample, bad_rows_problem, describe, make_summary
from data.readers import TEXT_MODES, Input, InputError, Skip, discover, read_rows
from data.store import StoreError

SCHEMA = pa.schema([("text", pa.string()), ("source", pa.string())])
ROW_GROUP_BYTES = 128 << 20  # a row group of huge documents is cut sooner: bounded memory, int32 offsets


class ShardWriter:
    """Parquet shards of `sizes` documents each (the next size when a shard opens), row group by row group."""

    def __init__(
        self, folder: Path, sizes: Iterator[int], row_group_docs: int, closed: Callable[[Path], None] | None = None
    ):
        self.folder, self.sizes, self.row_group_docs, self.closed = folder, sizes, row_group_docs, closed
        self.names: list[str] = []
        self.shard_docs: list[int] = []
        self.row_groups = 0
        self._writer: pq.ParquetWriter | None = None
        self._target = 0
        self._texts: list[str] = []
        self._sources: list[str] = []
        self._bytes = 0

    def add(self, text: str, source: str, size: int) -> None:
        if self._writer is None:
            self._open()
        self._texts.append(text)
        self._sources.append(source)
        self._bytes += size
        self.shard_docs[-1] += 1
        if len(self._texts) >= self.row_group_docs or self._bytes >= ROW_GROUP_BYTES:
            self._flush()
        if self.shard_docs[-1] >= self._target:
            self._close_shard()

    def _open(self) -> None:
        name = f"shard-{len(self.names):05d}.parquet"
        if len(self.names) >= 100_000:
            raise PrepareError("more than 100,000 shards: raise --docs-per-shard (or set --shards)")
        target = next(self.sizes, None)
        if target is None:
            raise PrepareError("the inputs hold more documents than the counting pass found: did they change?")
        self._target = target
        self._writer = pq.ParquetWriter(
            self.folder / name,
            SCHEMA,
            compression="zstd",
            compression_level=3,
            use_dictionary=["source"],
            write_statistics=["source"],  # min/max of whole documents would bloat every footer
        )
        self.names.append(name)
        self.shard_docs.append(0)

    def _flush(self) -> None:
        if self._texts and self._writer is not None:
            table = pa.table({"text": self._texts, "source": self._sources}, schema=SCHEMA)
            self._writer.write_table(table, row_group_size=len(self._texts))
            self.row_groups += 1
        self._texts, self._sources, self._bytes = [], [], 0

    def _close_shard(self) -> None:
        self._flush()
        if self._writer is not None:
            self._writer.close()
            if self.closed:
                self.closed(self.folder / self.names[-1])
        self._writer = None

    def close(self) -> list[str]:
        self._close_shard()
        return self.names


# -- the passes over the inputs -------------------------------------------------------------------


def convert(
    inputs: list[Input],
    text_key: str,
    text_mode: str,
    sink: Callable[[str, str, int], None] | None,
    samples: dict[str, Sample] | None,
) -> list[FileStats]:
    """One pass over every input: documents to `sink` (None: count only) and `samples`; stats per input."""
    stats: list[FileStats] = []
    last = time.monotonic()
    docs = 0
    for n, inp in enumerate(inputs):
        st = FileStats(inp.path, inp.kind, inp.source)
        stats.append(st)
        for row in read_rows(inp, text_key, text_mode):
            if isinstance(row, Skip):
                st.skip(row)
                continue
            size = len(row.encode("utf-8"))
            st.rows += 1
            st.documents += 1
            st.text_bytes += size
            docs += 1
            if sink is not None:
                sink(row, inp.source, size)
            if samples is not None:
                samples.setdefault(inp.source, Sample()).add(row, size)
            if docs % 4096 == 0 and time.monotonic() - last > 10:
                last = time.monotonic()
                print(f"... {docs:,} documents, input {n + 1} of {len(inputs)}: {inp.path}", file=sys.stderr)
    return stats


# -- command line ---------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m data.prepare",
        description="Convert JSON lines, text files, parquet and saved HF datasets into the parquet shards "
        "the loader reads, with a manifest, a shard index and a summary.",
    )
    p.add_argument(
        "out_dir",
        type=out_dir,
        help="the folder to create, or a prefix on object storage (s3://bucket/corpus); new or empty (see --overwrite)",
    )
    p.add_argument(
        "inputs",
        nargs="+",
        help="files (.jsonl/.ndjson/.txt, each also .gz or .zst; .parquet; .arrow), folders of them (read "
        "recursively in sorted order) or folders written by datasets.save_to_disk (one split)",
    )
    p.add_argument(
        "--source",
        default="",
        help="source tag of every document (default: each input argument's name without its suffixes; the files "
        "of a folder share the folder's name)",
    )
    p.add_argument("--text-key", default="text", help="the JSON key, or column, holding each document's text")
    p.add_argument(
        "--text-mode",
        choices=TEXT_MODES,
        default="file",
        help=".txt inputs: a document per file (default), per line, or per block between blank lines",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument("--docs-per-shard", type=int, default=50_000, help="documents per shard (default 50,000)")
    size.add_argument(
        "--shards", type=int, default=0, help="exactly this many shards of equal document counts (reads inputs twice)"
    )
    p.add_argument(
        "--row-group-docs",
        type=int,
        default=1000,
        help="documents per row group (default 1000; the loader shuffles within a row group and holds one)",
    )
    p.add_argument("--tokenizer", default="", help="a folder with tokenizer.json (or the file): estimate tokens")
    p.add_argument(
        "--min-shards",
        type=int,
        default=16,
        help="warn below this many shards (default 16, the loader's default [data] num_streams: each logical "
        "stream needs at least one shard; a multiple of num_streams keeps the streams' epochs equal)",
    )
    p.add_argument(
        "--max-bad-fraction",
        type=float,
        default=0.01,
        help="fail (exit 1, nothing written) when more than this fraction of all rows read is bad, naming the "
        "worst file (default 0.01)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it holds an earlier output")
    return p


def load_tokenizer(path: str) -> Tokenizer:
    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises its own exception type
        raise PrepareError(f"--tokenizer {path}: cannot load {file} ({e})") from e
    tokenizer.encode_special_tokens = True  # a special token's text in a document is text, as the loader encodes it
    return tokenizer


def shard_sizes(args: argparse.Namespace, documents: int) -> Iterator[int]:
    if not args.shards:
        return itertools.repeat(args.docs_per_shard)
    if documents < args.shards:
        raise PrepareError(f"--shards {args.shards}: only {documents:,} documents in the inputs")
    base, extra = divmod(documents, args.shards)
    return iter([base + (i < extra) for i in range(args.shards)])


def run(args: argparse.Namespace) -> dict[str, Any]:
    inputs, ignored = discover(args.inputs, args.source)
    remote = remote_output(args.out_dir, args.overwrite) if is_url(args.out_dir) else None
    out = Path(args.out_dir)
    if not remote:
        check_out_dir(out, args.overwrite, args.inputs)
        clean_stale(out)
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    documents = 0
    if args.shards:  # the counting pass: also fails on bad rows before anything is written
        counted = convert(inputs, args.text_key, args.text_mode, None, None)
        if problem := bad_rows_problem(counted, args.max_bad_fraction):
            raise PrepareError(problem)
        documents = sum(st.documents for st in counted)
    partial = scratch(out, remote)
    try:
        if remote:
            remote.claim()
            clear_old(remote)
        upload = (lambda path: remote.upload(str(path))) if remote else None
        writer = ShardWriter(partial, shard_sizes(args, documents), args.row_group_docs, upload)
        samples: dict[str, Sample] | None = {} if tokenizer else None
        stats = convert(inputs, args.text_key, args.text_mode, writer.add, samples)
        if problem := bad_rows_problem(stats, args.max_bad_fraction):
            raise PrepareError(problem)
        names = writer.close()
        if not names:
            raise PrepareError(f"no documents in the inputs ({sum(st.rows for st in stats):,} rows read, none kept)")
        if args.shards and len(names) != args.shards:
            raise PrepareError(f"--shards {args.shards}: wrote {len(names)}; did the inputs change while read?")
        where = remote.name_url if remote else lambda name: str(out.resolve() / name)
        manifest = "# written by python -m data.prepare\n" + "".join(f"{where(name)}\n" for name in names)
        if remote:
            (partial / INDEX_NAME).write_text(index_text(list(map(where, names)), where(INDEX_NAME))[0], "utf-8")
        else:
            write_index([str(partial / name) for name in names], str(partial / INDEX_NAME))
        (partial / "manifest.txt").write_text(manifest, encoding="utf-8")
        estimate = (tokenizer, args.tokenizer, samples) if tokenizer and samples is not None else None
        summary = make_summary(
            stats, ignored, writer.shard_docs, writer.row_groups, args.min_shards, settings(args), estimate
        )
        (partial / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n", "utf-8")
        publish(partial, out, remote)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        if remote:
            remote.abandon(say)
        raise
    return summary


def scratch(out: Path, remote: RemoteFolder | None) -> Path:
    """Where the output is built: a hidden sibling of OUT_DIR, renamed into place at the end; for object storage
    a local temporary folder (TMPDIR) holding a shard at a time, each uploaded as it closes."""
    if remote:
        return Path(tempfile.mkdtemp(prefix="data-prepare-"))
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(sibling(str(out), "partial"))
    os.mkdir(partial)
    return partial


def publish(partial: Path, out: Path, remote: RemoteFolder | None) -> None:
    if not remote:
        commit(partial, out)
        return
    for name in (INDEX_NAME, "manifest.txt", "summary.json"):  # the summary last: the output reads as complete
        remote.upload(str(partial / name))
    remote.finish()  # the marker goes
    shutil.rmtree(partial, ignore_errors=True)


def settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "inputs": [str(i) for i in args.inputs],
        "source": args.source,
        "text_key": args.text_key,
        "text_mode": args.text_mode,
        "docs_per_shard": 0 if args.shards else args.docs_per_shard,
        "shards": args.shards,
        "row_group_docs": args.row_group_docs,
        "max_bad_fraction": args.max_bad_fraction,
        "compression": "zstd level 3",
    }


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    for name in ("docs_per_shard", "row_group_docs"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.shards < 0 or args.min_shards < 0:
        p.error("--shards and --min-shards must not be negative")
    if not 0.0 <= args.max_bad_fraction <= 1.0:
        p.error("--max-bad-fraction must be between 0 and 1")
    start = time.monotonic()
    try:
        summary = run(args)
    except (InputError, PrepareError, OutputError, StoreError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(describe(summary))
    print(f"wrote {args.out_dir}/ (manifest.txt, {INDEX_NAME}, summary.json) in {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
