"""Parquet shards through fsspec: listing, schema checks, one row group at a time.

Only the text (and source) columns are read, and a row group at a time, so a
shard is never held in memory whole. Text columns may be any Arrow string type
(string, large_string, string_view, dictionary-encoded strings) or of type null
(every document missing); their bytes are checked to be UTF-8, since a parquet
writer may store them unvalidated.

A shard's identity is its size in bytes and a digest of its footer (the serialized FileMetaData, its
length and magic: the file's last bytes). The footer holds every column chunk's offsets and sizes and
the row groups' statistics, so a shard rewritten with other documents has another footer in practice;
both come from the one ranged read of the file's end that parsing the footer costs anyway.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import posixpath
import re
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from glob import has_magic
from typing import IO, Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from data.store import StoreError, filesystem, store_call

logger = logging.getLogger(__name__)


class BadShardError(ValueError):
    """A shard that cannot be used; the message names the file (and the row where there is one)."""


class NoDataError(ValueError):
    """Shards that yield no token (or no complete window): the message names them and what they held."""


class UnfinishedFolderError(ValueError):
    """A folder of shards that data.prepare is writing to object storage, or a killed run left: the marker it
    writes first and deletes last is there, so the folder may hold part of a corpus."""


PREPARING = "_PREPARING.json"  # data/prepare_output.py


def refuse_unfinished(folder_url: str, names: Iterable[str]) -> None:
    """Raise if `names` (a folder listing, base names) hold data.prepare's marker."""
    if PREPARING in names:
        raise UnfinishedFolderError(
            f"{folder_url}: data.prepare has not finished writing this folder ({folder_url}/{PREPARING} is there): "
            "wait for it, or rerun it with --overwrite if it was killed"
        )


def name_paths(paths: list[str], first: int = 4) -> str:
    """The paths for a message: all of them if few, else their count and the first few."""
    if len(paths) <= first:
        return ", ".join(paths) or "(no shards)"
    return f"{len(paths)} shards ({', '.join(paths[:first])}, ...)"


def path_kind(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    """'file', 'directory' or None (not there), from one metadata request."""
    try:
        return fs.info(path).get("type")
    except FileNotFoundError:
        return None


def _manifest_lines(manifest: str) -> list[str]:
    fs, bare = filesystem(manifest)
    with fs.open(bare, "r") as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def _matches(pattern: str) -> list[str]:
    """The URLs a glob, folder or path names (none if nothing is there)."""
    fs, bare = filesystem(pattern)
    matches = sorted(fs.glob(bare)) if has_magic(bare) else [bare]
    if len(matches) == 1:  # a plain path comes back as given, there or not: one look-up says which
        kind = path_kind(fs, matches[0])
        if kind == "directory":
            entries = fs.ls(matches[0], detail=False)
            refuse_unfinished(pattern.rstrip("/"), (posixpath.basename(p) for p in entries))
            matches = sorted(p for p in entries if p.endswith(".parquet"))
        elif kind is None:
            matches = []
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return [m if protocol == "file" else f"{protocol}://{m}" for m in matches]


def list_shards(paths: list[str], manifest: str = "") -> list[str]:
    """Shard URLs from globs/paths or a manifest file, sorted, each listed once; a store that cannot be read
    (no credentials, no answer) is a StoreError naming the URL."""
    if manifest:
        paths = store_call(manifest, "reading the manifest", partial(_manifest_lines, manifest))
    found: list[str] = []
    for pattern in paths:
        matches = store_call(pattern, "listing [data] paths", partial(_matches, pattern))
        if not matches:
            raise FileNotFoundError(f"[data] paths: {pattern!r} matches no parquet file")
        found += matches
    shards = sorted(set(found))
    if not shards:
        raise FileNotFoundError("[data] no shards: set [data] paths, [data] manifest or training.dataset_path")
    return shards


def is_text_type(kind: pa.DataType) -> bool:
    """Arrow types read as text: every string type, dictionary-encoded strings, and null (all missing)."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_string_view(kind)
        or pa.types.is_null(kind)
    )


# Text types as str() writes them (how the shard index stores column types); a dictionary's values count.
TEXT_TYPE_NAMES = ("string", "large_string", "string_view", "null")
_DICTIONARY_NAME = re.compile(r"dictionary<values=(\w+), indices=\w+, ordered=[01]>")


def is_text_type_name(name: str) -> bool:
    """`is_text_type` for a type given by its str(): the index checks columns without reading a footer."""
    match = _DICTIONARY_NAME.fullmatch(name)
    return (match.group(1) if match else name) in TEXT_TYPE_NAMES


@dataclass(frozen=True)
class ShardInfo:
    """What start-up knows of a usable shard: its row groups, and its size and footer digest (its identity)."""

    path: str
    row_groups: tuple[int, ...]  # rows per row group
    size: int  # bytes
    footer: str  # footer_digest of the shard's footer (hex)


@dataclass(frozen=True)
class Footer:
    """A footer's facts that start-up needs, independent of the columns a run reads."""

    row_groups: tuple[int, ...]  # rows per row group
    columns: tuple[tuple[str, str], ...]  # (name, Arrow type as str()) in schema order
    size: int  # the file's size in bytes
    digest: str  # footer_digest of the footer


FOOTER_READ = 64 * 1024  # what pyarrow reads first from a file's end: one ranged read holds most footers
FOOTER_DIGEST_CHARS = 32  # hex characters of a footer digest (blake2b, 16 bytes)
_HEX = re.compile(f"[0-9a-f]{{{FOOTER_DIGEST_CHARS}}}")


def footer_digest(tail: bytes) -> str:
    """The digest of a footer: blake2b (16 bytes, hex) of the FileMetaData, its 4-byte length and "PAR1"."""
    return hashlib.blake2b(tail, digest_size=16).hexdigest()


def is_footer_digest(value: object) -> bool:
    """Whether `value` looks like what `footer_digest` returns (the index checks its entries with it)."""
    return isinstance(value, str) and _HEX.fullmatch(value) is not None


class _Tail:
    """A file's last bytes, read once, standing for the whole file: pyarrow parses the footer from memory.

    A read before them (a footer pyarrow wants more of than was read) goes to the real file."""

    def __init__(self, handle: Any, size: int, start: int, data: bytes):
        self.handle, self.size, self.start, self.data, self.pos = handle, size, start, data, 0
        self.closed = False

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.pos = offset + {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.pos if n < 0 else min(n, self.size - self.pos)
        if self.pos >= self.start:
            out = self.data[self.pos - self.start : self.pos - self.start + n]
        else:
            self.handle.seek(self.pos)
            out = self.handle.read(n)
        self.pos += len(out)
        return out

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True


def _read_tail(f: IO[bytes]) -> _Tail:
    """The file's size and its last bytes, the whole footer among them where the file ends as parquet does."""
    f.seek(0, os.SEEK_END)
    size = f.tell()
    start = max(0, size - FOOTER_READ)
    f.seek(start)
    data = f.read(size - start)
    need = int.from_bytes(data[-8:-4], "little") + 8 if len(data) >= 8 and data[-4:] == b"PAR1" else 0
    if len(data) < need <= size:  # a footer over 64 KiB (a longer one than the file is pyarrow's error)
        f.seek(size - need)
        data = f.read(need - len(data)) + data
        start = size - need
    if len(data) != size - start:
        raise OSError(f"read {len(data)} of the last {size - start} bytes")
    return _Tail(f, size, start, data)


def _parse_footer(path: str) -> tuple[_Tail, pq.FileMetaData, pa.Schema]:
    fs, bare = filesystem(path)
    with fs.open(bare, "rb") as f:
        tail = _read_tail(f)
        parquet = pq.ParquetFile(tail)
        return tail, parquet.metadata, parquet.schema_arrow


def read_footer(path: str) -> Footer:
    """Row-group sizes, Arrow columns, size and footer digest of one shard, from one read of its end where
    the footer fits in 64 KiB; an unreadable file is a BadShardError naming it, a store that cannot be read
    a StoreError."""
    try:
        tail, meta, schema = store_call(path, "reading its footer", partial(_parse_footer, path))
    except StoreError:
        raise
    except Exception as e:  # pyarrow raises several types for unreadable files
        raise BadShardError(f"{path}: unreadable parquet ({type(e).__name__}: {e})") from e
    length = int.from_bytes(tail.data[-8:-4], "little")  # pyarrow checked the magic and length
    row_groups = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
    columns = tuple((field.name, str(field.type)) for field in schema)
    return Footer(row_groups, columns, tail.size, footer_digest(tail.data[-(length + 8) :]))


def check_columns(path: str, columns: Iterable[tuple[str, str]], text_column: str, source_column: str = "") -> None:
    """The text (and source) columns exist and hold strings; a BadShardError names the file and column."""
    columns = list(columns)
    kinds = dict(columns)
    for column in filter(None, (text_column, source_column)):
        if column not in kinds:
            names = ", ".join(name for name, _ in columns)
            raise BadShardError(f"{path}: no column {column!r} (columns: {names})")
        if not is_text_type_name(kinds[column]):
            raise BadShardError(f"{path}: column {column!r} holds {kinds[column]}, not strings (row 0 on)")


def shard_info(path: str, text_column: str, source_column: str = "") -> ShardInfo:
    """Row-group sizes, size and footer digest after checking the schema; a BadShardError names the file and
    what is wrong."""
    footer = read_footer(path)
    check_columns(path, footer.columns, text_column, source_column)
    return ShardInfo(path, footer.row_groups, footer.size, footer.digest)


def settle_bad_shards(shards: list[str], problems: list[BadShardError | None], on_bad_shard: str) -> list[str]:
    """The shards without a problem; with problems, the first is raised, or (skip) each is logged and dropped.

    Skipping every shard is an error (NoDataError naming them), not a run over nothing."""
    bad = [(path, err) for path, err in zip(shards, problems, strict=True) if err is not None]
    if bad and on_bad_shard != "skip":
        raise bad[0][1]
    for _, err in bad:
        logger.warning(f"[data] skipping shard: {err}")
    if bad and len(bad) == len(shards):
        raise NoDataError(f"[data] every shard is unusable, none left: {name_paths(shards)} (first: {bad[0][1]})")
    if bad:
        logger.warning(f"[data] skipped {len(bad)} of {len(shards)} shards at start-up")
    return [path for path, err in zip(shards, problems, strict=True) if err is None]


def check_shards(shards: list[str], text_column: str, source_column: str, on_bad_shard: str) -> list[str]:
    """The usable shards, after reading every footer (in parallel); bad ones raise or are dropped and logged.

    Skipping every shard is an error (NoDataError naming them), not a run over nothing."""

    def check(path: str) -> BadShardError | None:
        try:
            shard_info(path, text_column, source_column)
        except BadShardError as e:
            return e
        return None

    with ThreadPoolExecutor(max_workers=16) as pool:
        problems = list(pool.map(check, shards))
    return settle_bad_shards(shards, problems, on_bad_shard)


def _texts(table: pa.Table, column: str, path: str, index: int) -> list[str | None]:
    """A text column as Python strings, whatever its Arrow string type; invalid UTF-8 is a BadShardError."""
    values = table.column(column).cast(pa.large_string()).combine_chunks()
    try:
        values.validate(full=True)
    except pa.ArrowInvalid as e:
        where = re.search(r"string index (\d+)", str(e))
        row = f", row {where.group(1)}" if where else ""
        raise BadShardError(f"{path}: row group {index}{row}: column {column!r} is not valid UTF-8 ({e})") from e
    return values.to_pylist()


@functools.lru_cache(maxsize=64)
def _opened(path: str) -> tuple[int, pq.FileMetaData]:
    """A shard's size and parquet footer, read once per process: a stream reads a shard's row groups one after
    another, and on object storage each open would cost a HEAD and a footer GET before the row group's own."""
    fs, bare = filesystem(path)
    with fs.open(bare, "rb") as f:
        meta = pq.ParquetFile(f).metadata
        return f.seek(0, os.SEEK_END), meta


def _read_columns(path: str, index: int, columns: list[str]) -> pa.Table:
    size, meta = _opened(path)
    fs, bare = filesystem(path)
    known = {"size": size} if "s3" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)) else {}
    with fs.open(bare, "rb", **known) as f:  # s3fs asks no HEAD for a size it is given
        return pq.ParquetFile(f, metadata=meta).read_row_group(index, columns=columns)


def read_row_group(
    path: str, index: int, text_column: str, source_column: str = ""
) -> tuple[list[str | None], list[str | None]]:
    """(texts, sources) of one row group; sources are None without a source column. An unreadable (or deleted)
    shard is a BadShardError naming it, a store that cannot be read a StoreError (never skipped)."""
    columns = [c for c in (text_column, source_column) if c]
    try:
        table = store_call(path, f"reading row group {index}", partial(_read_columns, path, index, columns))
    except StoreError:
        raise
    except Exception as e:
        raise BadShardError(f"{path}: row group {index} unreadable ({type(e).__name__}: {e})") from e
    texts = _texts(table, text_column, path, index)
    sources = _texts(table, source_column, path, index) if source_column else [None] * len(texts)
    return texts, sources


def held_out(text: str, fraction: float) -> bool:
    """Whether a document belongs to the validation split: a stable hash of its text."""
    if fraction <= 0.0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


@dataclass
class Scan:
    """What a pass over shards found: rows read, documents empty or null, held out, shards skipped."""

    rows: int = 0
    documents: int = 0
    empty: int = 0
    held_out: int = 0
    skipped_shards: int = 0

    def describe(self, excluded: str = "held out for validation") -> str:
        return (
            f"{self.rows} rows: {self.empty} documents empty or null, {self.held_out} {excluded} "
            f"(validation_fraction), {self.documents} kept; {self.skipped_shards} shards skipped as bad"
        )


def find_documents(
    shards: list[str], text_column: str, keep: Callable[[str], bool], on_bad_shard: str, stop_at_first: bool = True
) -> Scan:
    """Read the shards' text (no tokenising) until a kept, non-empty document; counts what was passed."""
    scan = Scan()
    for path in shards:
        try:
            for index in range(len(shard_info(path, text_column).row_groups)):
                for text in read_row_group(path, index, text_column)[0]:
                    scan.rows += 1
                    if not text:
                        scan.empty += 1
                    elif not keep(text):
                        scan.held_out += 1
                    else:
                        scan.documents += 1
                        if stop_at_first:
                            return scan
        except BadShardError as e:
            if on_bad_shard != "skip":
                raise
            logger.warning(f"[data] skipping shard: {e}")
            scan.skipped_shards += 1
    return scan
