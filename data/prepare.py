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
processes of this host that are gone (a killed run) and mentions those of another host.
Memory: one row group of documents, plus the token sample (a few MB per source).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from data.atomic import clean_stale as clean_stale_siblings
from data.atomic import sibling
from data.index import INDEX_NAME, write_index
from data.prepare_report import FileStats, Sample, bad_rows_problem, describe, make_summary
from data.readers import TEXT_MODES, Input, InputError, Skip, discover, read_rows

SCHEMA = pa.schema([("text", pa.string()), ("source", pa.string())])
ROW_GROUP_BYTES = 128 << 20  # a row group of huge documents is cut sooner: bounded memory, int32 offsets
OURS = re.compile(r"shard-\d{5,}\.parquet|manifest\.txt|summary\.json|" + re.escape(INDEX_NAME))


class PrepareError(Exception):
    """A run that cannot go on; the message says why, naming the file or option."""


class ShardWriter:
    """Parquet shards of `sizes` documents each (the next size when a shard opens), row group by row group."""

    def __init__(self, folder: Path, sizes: Iterator[int], row_group_docs: int):
        self.folder, self.sizes, self.row_group_docs = folder, sizes, row_group_docs
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


# -- the output folder ----------------------------------------------------------------------------


def check_out_dir(out: Path, overwrite: bool, inputs: list[str]) -> None:
    """OUT_DIR must be new, empty or (with --overwrite) an earlier output, and outside the input folders."""
    if out.exists() and not out.is_dir():
        raise PrepareError(f"{out}: exists and is not a folder")
    entries = sorted(p.name for p in out.iterdir()) if out.exists() else []
    if entries and not overwrite:
        raise PrepareError(f"{out}: not empty ({len(entries)} entries, e.g. {entries[0]}); pass --overwrite to replace")
    foreign = [name for name in entries if not OURS.fullmatch(name)]
    if foreign:
        raise PrepareError(
            f"{out}: holds files data.prepare does not write ({', '.join(foreign[:5])}); refusing to replace it"
        )
    resolved = out.resolve()
    for arg in inputs:
        folder = Path(arg).resolve()
        if folder.is_dir() and resolved.is_relative_to(folder):
            raise PrepareError(f"{out}: inside the input folder {arg}; a later run would read its shards as input")


def clean_stale(out: Path) -> None:
    """Remove the temporary folders (`partial`: an output being built; `old`: the output it replaced) of
    runs to `out` whose process on this host is gone, saying so (data/atomic.py). An `old` folder is
    kept while `out` is missing: it may hold the only copy of the previous output."""

    def keep(kind: str) -> str | None:
        return (
            f"the earlier output, moved aside before {out} was replaced" if kind == "old" and not out.exists() else None
        )

    clean_stale_siblings(
        str(out), ("partial", "old"), "python -m data.prepare", lambda line: print(line, file=sys.stderr), keep
    )


def commit(partial: Path, out: Path) -> None:
    """Put the finished folder in place: the old output (if any) moves aside first, then goes."""
    if out.exists():
        old = Path(sibling(str(out), "old"))
        os.rename(out, old)
        os.rename(partial, out)
        shutil.rmtree(old)
    else:
        os.rename(partial, out)


# -- command line ---------------------------------------------------------------------------------


def local_folder(value: str) -> Path:
    """OUT_DIR as a path; a URL is refused here, before Path turns `s3://b/x` into the local folder `s3:/b/x`."""
    if "://" in value:
        raise argparse.ArgumentTypeError(
            f"{value} is a URL: data.prepare writes a local or shared folder (it builds the shards beside OUT_DIR "
            "and renames them into place, which object storage cannot do); the loader reads shards from URLs"
        )
    return Path(value)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m data.prepare",
        description="Convert JSON lines, text files, parquet and saved HF datasets into the parquet shards "
        "the loader reads, with a manifest, a shard index and a summary.",
    )
    p.add_argument("out_dir", type=local_folder, help="the folder to create; it must be new or empty (see --overwrite)")
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
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises its own exception type
        raise PrepareError(f"--tokenizer {path}: cannot load {file} ({e})") from e


def shard_sizes(args: argparse.Namespace, documents: int) -> Iterator[int]:
    if not args.shards:
        return itertools.repeat(args.docs_per_shard)
    if documents < args.shards:
        raise PrepareError(f"--shards {args.shards}: only {documents:,} documents in the inputs")
    base, extra = divmod(documents, args.shards)
    return iter([base + (i < extra) for i in range(args.shards)])


def run(args: argparse.Namespace) -> dict[str, Any]:
    inputs, ignored = discover(args.inputs, args.source)
    out: Path = args.out_dir
    check_out_dir(out, args.overwrite, args.inputs)
    clean_stale(out)
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    documents = 0
    if args.shards:  # the counting pass: also fails on bad rows before anything is written
        counted = convert(inputs, args.text_key, args.text_mode, None, None)
        if problem := bad_rows_problem(counted, args.max_bad_fraction):
            raise PrepareError(problem)
        documents = sum(st.documents for st in counted)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(sibling(str(out), "partial"))
    os.mkdir(partial)
    try:
        writer = ShardWriter(partial, shard_sizes(args, documents), args.row_group_docs)
        samples: dict[str, Sample] | None = {} if tokenizer else None
        stats = convert(inputs, args.text_key, args.text_mode, writer.add, samples)
        if problem := bad_rows_problem(stats, args.max_bad_fraction):
            raise PrepareError(problem)
        names = writer.close()
        if not names:
            raise PrepareError(f"no documents in the inputs ({sum(st.rows for st in stats):,} rows read, none kept)")
        if args.shards and len(names) != args.shards:
            raise PrepareError(f"--shards {args.shards}: wrote {len(names)}; did the inputs change while read?")
        final = out.resolve()
        manifest = "# written by python -m data.prepare\n" + "".join(f"{final / name}\n" for name in names)
        (partial / "manifest.txt").write_text(manifest, encoding="utf-8")
        write_index([str(partial / name) for name in names], str(partial / INDEX_NAME))
        estimate = (tokenizer, args.tokenizer, samples) if tokenizer and samples is not None else None
        summary = make_summary(
            stats, ignored, writer.shard_docs, writer.row_groups, args.min_shards, settings(args), estimate
        )
        (partial / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n", "utf-8")
        commit(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return summary


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
    except (InputError, PrepareError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(describe(summary))
    print(f"wrote {args.out_dir}/ (manifest.txt, {INDEX_NAME}, summary.json) in {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
