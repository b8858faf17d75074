"""Parquet shards through fsspec: listing, schema checks, one row group at a time.

Only the text (and source) columns are read, and a row group at a time, so a
shard is never held in memory whole.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

logger = logging.getLogger(__name__)


class BadShardError(ValueError):
    """A shard that cannot be used; the message names the file (and the row where there is one)."""


def list_shards(paths: list[str], manifest: str = "") -> list[str]:
    """Shard URLs from globs/paths or a manifest file, sorted, each listed once."""
    if manifest:
        with fsspec.open(manifest, "r") as f:
            paths = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    found: list[str] = []
    for pattern in paths:
        fs, _, matches = fsspec.get_fs_token_paths(pattern)
        if len(matches) == 1 and fs.isdir(matches[0]):
            matches = sorted(p for p in fs.ls(matches[0], detail=False) if p.endswith(".parquet"))
        if not matches:
            raise FileNotFoundError(f"[data] paths: {pattern!r} matches no parquet file")
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        found += [m if protocol == "file" else f"{protocol}://{m}" for m in matches]
    shards = sorted(set(found))
    if not shards:
        raise FileNotFoundError("[data] no shards: set [data] paths, [data] manifest or training.dataset_path")
    return shards


@dataclass(frozen=True)
class ShardInfo:
    path: str
    row_groups: tuple[int, ...]  # rows per row group


def shard_info(path: str, text_column: str, source_column: str = "") -> ShardInfo:
    """Row-group sizes after checking the schema; a BadShardError names the file and what is wrong."""
    try:
        with fsspec.open(path, "rb") as f:
            meta = pq.ParquetFile(f).metadata
            schema = meta.schema.to_arrow_schema()
    except Exception as e:  # pyarrow raises several types for unreadable files
        raise BadShardError(f"{path}: unreadable parquet ({type(e).__name__}: {e})") from e
    for column in filter(None, (text_column, source_column)):
        if column not in schema.names:
            raise BadShardError(f"{path}: no column {column!r} (columns: {', '.join(schema.names)})")
        kind = schema.field(column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise BadShardError(f"{path}: column {column!r} holds {kind}, not strings (row 0 on)")
    return ShardInfo(path, tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups)))


def check_shards(shards: list[str], text_column: str, source_column: str, on_bad_shard: str) -> list[str]:
    """The usable shards, after reading every footer (in parallel); bad ones raise or are dropped and logged."""
    from concurrent.futures import ThreadPoolExecutor

    def check(path: str) -> BadShardError | None:
        try:
            shard_info(path, text_column, source_column)
        except BadShardError as e:
            return e
        return None

    with ThreadPoolExecutor(max_workers=16) as pool:
        problems = list(pool.map(check, shards))
    bad = [(path, err) for path, err in zip(shards, problems, strict=True) if err is not None]
    if bad and on_bad_shard != "skip":
        raise bad[0][1]
    for _, err in bad:
        logger.warning(f"[data] skipping shard: {err}")
    if bad:
        logger.warning(f"[data] skipped {len(bad)} of {len(shards)} shards at start-up")
    return [path for path, err in zip(shards, problems, strict=True) if err is None]


def read_row_group(
    path: str, index: int, text_column: str, source_column: str = ""
) -> tuple[list[str | None], list[str | None]]:
    """(texts, sources) of one row group; sources are None without a source column."""
    columns = [c for c in (text_column, source_column) if c]
    try:
        with fsspec.open(path, "rb") as f:
            table = pq.ParquetFile(f).read_row_group(index, columns=columns)
    except Exception as e:
        raise BadShardError(f"{path}: row group {index} unreadable ({type(e).__name__}: {e})") from e
    texts = table.column(text_column).to_pylist()
    sources = table.column(source_column).to_pylist() if source_column else [None] * len(texts)
    return texts, sources


def held_out(text: str, fraction: float) -> bool:
    """Whether a document belongs to the validation split: a stable hash of its text."""
    if fraction <= 0.0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction
