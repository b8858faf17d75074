"""The inputs `data.prepare` reads, streamed a row at a time, each row a document or a counted Skip.

Kinds, by name: JSON lines (`.jsonl`, `.ndjson`, optionally `.gz` or `.zst`), text (`.txt`, same
compressions; `--text-mode`: a document per file, per line, or per block between blank lines),
parquet (`.parquet`), Arrow IPC (`.arrow`) and folders that `datasets.save_to_disk` wrote (their
`.arrow` files in `state.json`'s order). A folder of other files is read in sorted path order;
files it holds of no known kind (and hidden ones) are returned as ignored, for the report.

A Skip names its reason and place: `file:line` (1-based) for line-based files, `file: row N`
(0-based, as the loader's messages) for tables. Empty documents and blank lines are skipped but
are not bad rows. A byte-order mark at the start of a text file is not part of its first document.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from data.shards import is_text_type

BAD_REASONS = ("invalid JSON", "not a JSON object", "missing text key", "text not a string", "invalid UTF-8")
EMPTY_REASONS = ("empty text", "blank line")
TEXT_MODES = ("file", "lines", "blank-lines")
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
KINDS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".txt": "text", ".parquet": "parquet", ".arrow": "arrow"}
CHUNK = 1 << 22  # bytes read from a line-based file at a time
BOM = b"\xef\xbb\xbf"


class InputError(ValueError):
    """An input that cannot be read at all (not one bad row); the message names it."""


@dataclass(frozen=True)
class Input:
    path: str  # a file, or a folder written by datasets.save_to_disk
    kind: str  # jsonl, text, parquet, arrow or hf-dataset
    source: str
    compression: str | None = None  # gzip or zstd (line-based kinds only)


@dataclass(frozen=True)
class Skip:
    """A row not written: why, where, and how many rows it stands for (a whole table without the column)."""

    reason: str
    where: str
    detail: str = ""
    count: int = 1

    @property
    def bad(self) -> bool:
        return self.reason in BAD_REASONS

    def describe(self) -> str:
        return f"{self.where}: {self.reason}" + (f" ({self.detail})" if self.detail else "")


# -- finding the inputs ---------------------------------------------------------------------------


def _kind(name: str) -> tuple[str, str | None] | None:
    """(kind, compression) from a file name, or None for a name of no known kind."""
    stem, ext = os.path.splitext(name)
    compression = COMPRESSIONS.get(ext)
    if compression:
        stem, ext = os.path.splitext(stem)
    kind = KINDS.get(ext)
    if kind is None or (compression and kind not in ("jsonl", "text")):
        return None
    return kind, compression


def source_name(arg: str) -> str:
    """The default source of an input argument: its name without the suffixes of known kinds."""
    name = Path(arg).name or Path(arg).resolve().name
    if name in ("", ".", ".."):
        name = Path(arg).resolve().name
    while os.path.splitext(name)[1] in (*COMPRESSIONS, *KINDS):
        name = os.path.splitext(name)[0]
    return name or "input"


def _is_hf_dataset(folder: Path) -> bool:
    return (folder / "state.json").is_file()


def _refuse_dataset_dict(folder: Path) -> None:
    if (folder / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in folder.iterdir() if p.is_dir()) or ["(none)"]
        raise InputError(
            f"{folder}: a DatasetDict of splits ({', '.join(splits)}); name the split folder to convert, "
            f"e.g. {folder / splits[0]}"
        )


def _folder(root: Path, source: str) -> tuple[list[Input], list[str]]:
    found: list[tuple[str, Input]] = []
    ignored: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        for name in sorted(dirnames):
            sub = here / name
            if name.startswith("."):
                ignored.append(f"{sub}/ (hidden folder)")
                dirnames.remove(name)
            elif _is_hf_dataset(sub):
                found.append((str(sub.relative_to(root)), Input(str(sub), "hf-dataset", source)))
                dirnames.remove(name)
            else:
                _refuse_dataset_dict(sub)
        for name in filenames:
            kind = None if name.startswith(".") else _kind(name)
            if kind is None:
                ignored.append(str(here / name))
            else:
                found.append((str((here / name).relative_to(root)), Input(str(here / name), kind[0], source, kind[1])))
    return [inp for _, inp in sorted(found, key=lambda item: item[0])], sorted(ignored)


def discover(args: list[str], source: str = "") -> tuple[list[Input], list[str]]:
    """The inputs named by the arguments, in their order (a folder's files sorted), and the files
    ignored in folders; a missing or unknown input, or one named twice, is an InputError."""
    inputs: list[Input] = []
    ignored: list[str] = []
    for arg in args:
        path = Path(arg)
        name = source or source_name(arg)
        if path.is_dir():
            _refuse_dataset_dict(path)
            if _is_hf_dataset(path):
                inputs.append(Input(str(path), "hf-dataset", name))
            else:
                found, skipped = _folder(path, name)
                if not found:
                    raise InputError(f"{arg}: a folder without any input of a known kind ({', '.join(KINDS)})")
                inputs += found
                ignored += skipped
        elif path.is_file():
            kind = _kind(path.name)
            if kind is None:
                known = ", ".join(KINDS) + " (.jsonl and .txt also .gz, .zst)"
                raise InputError(f"{arg}: not an input of a known kind ({known})")
            inputs.append(Input(str(path), kind[0], name, kind[1]))
        else:
            raise InputError(f"{arg}: no such file or folder")
    seen: dict[str, str] = {}
    for inp in inputs:
        real = os.path.realpath(inp.path)
        if real in seen:
            raise InputError(f"{inp.path}: named twice (also as {seen[real]}); its documents would be written twice")
        seen[real] = inp.path
    return inputs, ignored


# -- reading --------------------------------------------------------------------------------------


def _lines(path: str, compression: str | None) -> Iterator[bytes]:
    """The lines of a file (without their newline), in chunks; a truncated or corrupt file is an InputError."""
    n = 0
    try:
        with pa.input_stream(path, compression=compression) as stream:
            pending: list[bytes] = []
            while chunk := stream.read(CHUNK):
                parts = chunk.split(b"\n")
                if len(parts) == 1:
                    pending.append(chunk)
                    continue
                pending.append(parts[0])
                lines = [b"".join(pending), *parts[1:-1]]
                pending = [parts[-1]]
                for line in lines:
                    n += 1
                    yield line.removeprefix(BOM) if n == 1 else line
            tail = b"".join(pending)
            if tail:
                yield tail.removeprefix(BOM) if n == 0 else tail
    except OSError as e:
        raise InputError(f"{path}: unreadable after line {n} ({e})") from e


def _decode(line: bytes, where: str) -> str | Skip:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as e:
        return Skip("invalid UTF-8", where, f"byte {e.start}")


def _json_rows(inp: Input, text_key: str) -> Iterator[str | Skip]:
    for n, line in enumerate(_lines(inp.path, inp.compression), 1):
        where = f"{inp.path}:{n}"
        if not line.strip():
            yield Skip("blank line", where)
            continue
        text = _decode(line, where)
        if isinstance(text, Skip):
            yield text
            continue
        try:
            row = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            yield Skip("invalid JSON", where, getattr(e, "msg", type(e).__name__))
            continue
        if not isinstance(row, dict):
            yield Skip("not a JSON object", where, f"a JSON {type(row).__name__}")
        elif text_key not in row:
            yield Skip("missing text key", where, f"keys: {', '.join(list(row)[:8])}")
        elif not isinstance(row[text_key], str):
            yield Skip("text not a string", where, "null" if row[text_key] is None else type(row[text_key]).__name__)
        elif not row[text_key]:
            yield Skip("empty text", where)
        else:
            try:
                row[text_key].encode("utf-8")
            except UnicodeEncodeError:
                yield Skip("invalid UTF-8", where, "a lone surrogate escape")
                continue
            yield row[text_key]


def _whole(inp: Input) -> bytes:
    """A whole text file's bytes, its byte-order mark removed."""
    try:
        with pa.input_stream(inp.path, compression=inp.compression) as stream:
            return stream.read().removeprefix(BOM)
    except OSError as e:
        raise InputError(f"{inp.path}: unreadable ({e})") from e


def _text_rows(inp: Input, mode: str) -> Iterator[str | Skip]:
    if mode == "file":
        data = _whole(inp)
        if not data:
            yield Skip("empty text", f"{inp.path}:1")
            return
        try:
            yield data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            yield Skip("invalid UTF-8", f"{inp.path}:{line}", f"byte {e.start}")
        return
    block: list[bytes] = []
    first = 0
    for n, line in enumerate(_lines(inp.path, inp.compression), 1):
        line = line.removesuffix(b"\r")
        if mode == "lines":
            yield _decode(line, f"{inp.path}:{n}") if line.strip() else Skip("blank line", f"{inp.path}:{n}")
        elif line.strip():
            first = first or n
            block.append(line)
        elif block:
            yield _decode(b"\n".join(block), f"{inp.path}:{first}")
            block, first = [], 0
    if block:
        yield _decode(b"\n".join(block), f"{inp.path}:{first}")


def _table_rows(
    path: str, schema: pa.Schema, batches: Iterator[pa.RecordBatch], rows: Callable[[], int], text_key: str
) -> Iterator[str | Skip]:
    """Rows of a table's text column; a missing or non-string column makes every row bad, in one Skip
    (`rows()` counts them)."""
    if text_key not in schema.names:
        detail = f"no column {text_key!r}; columns: {', '.join(schema.names)}"
        yield _whole_table(path, "missing text key", detail, rows())
        return
    kind = schema.field(text_key).type
    if not is_text_type(kind) or pa.types.is_null(kind):
        yield _whole_table(path, "text not a string", f"column {text_key!r} holds {kind}", rows())
        return
    row = 0
    for batch in batches:
        column = batch.column(text_key).cast(pa.large_string())
        try:
            column.validate(full=True)
            values: list[str | Skip | None] = column.to_pylist()
        except pa.ArrowInvalid:  # invalid UTF-8 somewhere in the batch: find the rows
            raw = column.view(pa.large_binary()).to_pylist()
            values = [None if v is None else _decode(v, f"{path}: row {row + i}") for i, v in enumerate(raw)]
        for i, value in enumerate(values):
            if value is None:
                yield Skip("text not a string", f"{path}: row {row + i}", "null")
            elif isinstance(value, Skip):
                yield value
            elif not value:
                yield Skip("empty text", f"{path}: row {row + i}")
            else:
                yield value
        row += len(values)


def _whole_table(path: str, reason: str, detail: str, rows: int) -> Skip:
    return Skip(reason, f"{path}: rows 0-{rows - 1}" if rows else path, detail, rows)


def _arrow_rows(path: str, text_key: str) -> Iterator[str | Skip]:
    """An Arrow IPC file or stream (datasets writes streams), memory-mapped, a record batch at a time."""
    try:
        source = pa.memory_map(path)
    except OSError as e:
        raise InputError(f"{path}: unreadable ({e})") from e
    with source:
        try:
            if source.read(6) == b"ARROW1":
                reader = pa.ipc.open_file(source)
                batches: Iterator[pa.RecordBatch] = (reader.get_batch(i) for i in range(reader.num_record_batches))
                schema = reader.schema
            else:
                source.seek(0)
                stream = pa.ipc.open_stream(source)
                batches, schema = iter(stream), stream.schema
        except (OSError, pa.ArrowInvalid) as e:
            raise InputError(f"{path}: not a readable Arrow IPC file ({type(e).__name__}: {e})") from e
        try:
            yield from _table_rows(path, schema, batches, lambda: sum(b.num_rows for b in batches), text_key)
        except (OSError, pa.ArrowInvalid) as e:
            raise InputError(f"{path}: unreadable Arrow IPC data ({type(e).__name__}: {e})") from e


def _parquet_rows(path: str, text_key: str) -> Iterator[str | Skip]:
    try:
        with pq.ParquetFile(path) as parquet:
            schema, rows = parquet.schema_arrow, parquet.metadata.num_rows
            columns = [text_key] if text_key in schema.names else []
            batches = parquet.iter_batches(batch_size=1024, columns=columns)
            yield from _table_rows(path, schema, batches, lambda: rows, text_key)
    except (OSError, pa.ArrowInvalid) as e:
        raise InputError(f"{path}: unreadable parquet ({type(e).__name__}: {e})") from e


def _dataset_files(folder: str) -> list[str]:
    """A save_to_disk folder's .arrow files, in state.json's order."""
    state_path = Path(folder) / "state.json"
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{state_path}: not a datasets state.json with _data_files ({type(e).__name__}: {e})") from e
    for name in names:
        if not (Path(folder) / name).is_file():
            raise InputError(f"{folder}: state.json names {name}, which is missing")
    return [str(Path(folder) / name) for name in names]


def read_rows(inp: Input, text_key: str = "text", text_mode: str = "file") -> Iterator[str | Skip]:
    """Every row of one input, in order: its document's text, or a Skip saying why not."""
    if inp.kind == "jsonl":
        yield from _json_rows(inp, text_key)
    elif inp.kind == "text":
        yield from _text_rows(inp, text_mode)
    elif inp.kind == "parquet":
        yield from _parquet_rows(inp.path, text_key)
    elif inp.kind == "arrow":
        yield from _arrow_rows(inp.path, text_key)
    elif inp.kind == "hf-dataset":
        for path in _dataset_files(inp.path):
            yield from _arrow_rows(path, text_key)
    else:
        raise ValueError(f"{inp.path}: unknown input kind {inp.kind!r}")
