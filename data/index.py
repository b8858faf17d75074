"""A JSON index of a corpus's parquet footers, so start-up costs a few requests, not two per shard per rank.

`_index.json` beside the shards records, per shard, its path relative to the index's folder, its
size in bytes, its rows per row group, its Arrow columns (name and type as str()) and its footer digest
(`shards.footer_digest`, the shard's content identity with its size), plus a format version; unreadable
shards are recorded with their error. An entry without a footer digest (an index written before they
were recorded) is valid, but its shard's footer is read at start-up. `shard_infos` answers what
`shards.shard_info` answers for every shard, from the index where it covers the shard, else from
the footer (read in parallel). Coverage is checked against one listing per folder: a shard missing
from the index, or whose size differs from the one recorded, is read from its footer with a warning
naming both sizes (a stale entry never decides a run, and rebuilding is one command). A malformed
index, or one of another format version, is an error naming the file and key.

In a distributed job `startup_shards` lists and checks on rank 0 alone and broadcasts the answer as
JSON text; an error on rank 0 is raised on every rank, so no rank waits for a broadcast that never
comes. Build an index for an existing corpus with `python -m data.index SHARD_DIR_OR_GLOB`
(`python -m data.prepare` writes one).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import posixpath
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from fnmatch import fnmatchcase
from glob import has_magic
from typing import Any, Protocol

import fsspec
import torch
import torch.distributed as dist

from data.listing import Place, folder_sizes, locate, locate_all, to_url
from data.shards import (
    PREPARING,
    BadShardError,
    Footer,
    NoDataError,
    ShardInfo,
    check_columns,
    is_footer_digest,
    list_shards,
    read_footer,
    refuse_unfinished,
    settle_bad_shards,
)
from data.store import CONNECTIONS, StoreError, filesystem, store_call

logger = logging.getLogger(__name__)

INDEX_NAME = "_index.json"
FORMAT = "mhar-titan shard index"
VERSION = 1
FOOTER_THREADS = CONNECTIONS  # footer reads are latency-bound: many in flight hide a remote store's round trips


class BadIndexError(ValueError):
    """An index file that cannot be used; the message names the file and the key."""


# -- footers ------------------------------------------------------------------------------------


def read_footers(paths: list[str], threads: int = FOOTER_THREADS) -> list[Footer | BadShardError]:
    """Every shard's footer, in parallel, in the order given; logs progress every 10% or 5 s (corpora of
    100 shards and more), and once when done."""
    results: list[Footer | BadShardError] = []
    start = last = time.monotonic()
    step = max(1, len(paths) // 10) if len(paths) >= 100 else len(paths)
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(paths)))) as pool:
        futures = [pool.submit(_footer, path) for path in paths]
        for done, _ in enumerate(as_completed(futures), 1):
            now = time.monotonic()
            if done % step == 0 or now - last >= 5.0 or done == len(paths):
                logger.info(f"[data] read {done} of {len(paths)} shard footers ({now - start:.1f} s)")
                last = now
        results = [future.result() for future in futures]
    return results


def _footer(path: str) -> Footer | BadShardError:
    try:
        return read_footer(path)
    except BadShardError as e:
        return e


# -- the index file -----------------------------------------------------------------------------


def write_index(shards: list[str], path: str, threads: int = FOOTER_THREADS) -> dict[str, Any]:
    """Write the index of `shards` (each below the index's folder) to `path`, atomically; returns it."""
    text, index = index_text(shards, path, threads)
    temporary = f"{path}.tmp-{os.getpid()}"
    with fsspec.open(temporary, "w", encoding="utf-8") as f:
        f.write(text)
    locate(path)[0].mv(locate(temporary)[1], locate(path)[1])
    return index


def index_text(shards: list[str], path: str, threads: int = FOOTER_THREADS) -> tuple[str, dict[str, Any]]:
    """The index of `shards` that belongs at `path` (its entries name them relative to its folder), as written
    and as read.

    Sizes are listed before the footers are read: a shard rewritten in between then mismatches its
    recorded size later and is re-read, never trusted with an old size and a new footer."""
    base = locate(path)[2]
    places = locate_all(shards)
    relative = []
    for shard in shards:
        bare = places[shard][1]
        if not bare.startswith(base.rstrip("/") + "/"):
            raise ValueError(f"{shard}: not below the index's folder {base}; write the index higher up (--out)")
        relative.append(bare[len(base.rstrip("/")) + 1 :])
    sizes = folder_sizes(places, threads)
    footers = read_footers(shards, threads)
    entries = []
    for shard, rel, footer in sorted(zip(shards, relative, footers, strict=True), key=lambda item: item[1]):
        bare = places[shard][1]
        if bare not in sizes:
            raise FileNotFoundError(f"{shard}: not in its folder's listing (removed while indexing?)")
        entry: dict[str, Any] = {"path": rel, "bytes": sizes[bare]}
        if isinstance(footer, BadShardError):
            entry["error"] = str(footer).removeprefix(f"{shard}: ")
        else:
            entry["row_groups"] = list(footer.row_groups)
            entry["columns"] = [list(column) for column in footer.columns]
            entry["footer"] = footer.digest
        entries.append(entry)
    lines = [json.dumps(entry, ensure_ascii=False, separators=(", ", ": ")) for entry in entries]
    head = json.dumps({"format": FORMAT, "version": VERSION})[:-1]
    text = head + ', "shards": [\n' + ",\n".join(lines) + "\n]}\n"
    return text, {"format": FORMAT, "version": VERSION, "shards": entries}


def _check_entry(where: str, entry: object) -> None:
    if not isinstance(entry, dict):
        raise BadIndexError(f"{where}: {entry!r} is not an object")
    rel = entry.get("path")
    if not isinstance(rel, str) or not rel or rel.startswith("/") or ".." in rel.split("/") or "://" in rel:
        raise BadIndexError(f"{where}.path: {rel!r} is not a path relative to the index's folder")
    size = entry.get("bytes")
    if type(size) is not int or size < 0:
        raise BadIndexError(f"{where}.bytes: {size!r} is not a non-negative integer")
    if "error" in entry:
        if not isinstance(entry["error"], str) or set(entry) != {"path", "bytes", "error"}:
            raise BadIndexError(f"{where}: an unreadable shard's entry holds path, bytes and an error string only")
        return
    if set(entry) - {"footer"} != {"path", "bytes", "row_groups", "columns"}:
        raise BadIndexError(f"{where}: keys {sorted(entry)}, not path, bytes, row_groups, columns (and footer)")
    if "footer" in entry and not is_footer_digest(entry["footer"]):
        raise BadIndexError(f"{where}.footer: {entry['footer']!r} is not a footer digest (32 lowercase hex digits)")
    groups = entry["row_groups"]
    if not isinstance(groups, list) or not all(type(n) is int and n >= 0 for n in groups):
        raise BadIndexError(f"{where}.row_groups: {groups!r} is not a list of non-negative integers")
    columns = entry["columns"]
    if not isinstance(columns, list) or not all(
        isinstance(c, list) and len(c) == 2 and all(isinstance(x, str) for x in c) for c in columns
    ):
        raise BadIndexError(f"{where}.columns: {columns!r} is not a list of [name, type] string pairs")


def read_index(path: str) -> dict[str, Any]:
    """An index file, checked key by key; anything malformed is a BadIndexError naming the file and key."""
    try:
        fs, bare = filesystem(path)
        index = store_call(path, "reading the shard index", lambda: json.loads(fs.cat_file(bare)))
    except StoreError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadIndexError(f"{path}: not a readable shard index ({type(e).__name__}: {e})") from e
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise BadIndexError(f'{path}: not a shard index (no "format": {FORMAT!r})')
    if index.get("version") != VERSION:
        raise BadIndexError(
            f"{path}: version {index.get('version')!r}; this mhar-titan reads version {VERSION} "
            "(rebuild it: python -m data.index FOLDER)"
        )
    if not isinstance(index.get("shards"), list):
        raise BadIndexError(f"{path}: shards: not a list")
    seen = set()
    for i, entry in enumerate(index["shards"]):
        _check_entry(f"{path}: shards[{i}]", entry)
        if entry["path"] in seen:
            raise BadIndexError(f"{path}: shards[{i}].path: {entry['path']!r} is listed twice")
        seen.add(entry["path"])
    return index


# -- start-up -----------------------------------------------------------------------------------


Indexes = dict[str, tuple[Any, str, dict[str, dict[str, Any]]]]  # index URL -> (filesystem, its folder, entries)


def _indexed_entries(
    places: dict[str, Place], sizes: dict[str, int], index: str
) -> tuple[dict[str, dict[str, Any]], Indexes]:
    """The index entry of each shard an index covers, with the index's URL under "index", and the indexes read.
    `index` names one file; "" means `_index.json` in each shard's folder, where that folder's listing holds one."""
    named = locate(index) if index else None
    files: Indexes = {}
    local: dict[str, str] = {}  # folder -> the URL of its index, "" without one
    found: dict[str, dict[str, Any]] = {}
    for shard, (fs, bare, folder) in places.items():
        if named is not None:
            if named[0] is not fs:
                continue
            url, base = index, named[2]
        else:
            if folder not in local:
                candidate = posixpath.join(folder, INDEX_NAME)
                local[folder] = to_url(fs, candidate) if candidate in sizes else ""
            url, base = local[folder], folder
            if not url:
                continue
        if url not in files:
            files[url] = (fs, base, {entry["path"]: entry for entry in read_index(url)["shards"]})
        prefix = base.rstrip("/") + "/"
        entry = files[url][2].get(bare[len(prefix) :]) if bare.startswith(prefix) else None
        if entry is not None:
            found[shard] = entry | {"index": url}
    if named is not None and not found:
        logger.warning(f"[data] the shard index {index} covers none of the {len(places)} shards: reading footers")
    return found, files


def _selects(selection: str, bare: str) -> bool:
    """A glob selects what it matches, a folder its own shards."""
    return fnmatchcase(bare, selection) if has_magic(selection) else posixpath.dirname(bare) == selection


def _gone(indexes: Indexes, sizes: dict[str, int], shards: list[str], paths: list[str]) -> dict[str, str]:
    """{URL: problem} for each shard an index lists, in a folder that was listed, that `paths` select (a folder:
    its own shards; a glob: what it matches) and that the listing lacks: deleted after the index was written."""
    selections = []
    for pattern in paths:
        fs, bare = filesystem(pattern)
        bare = bare.rstrip("/")
        if has_magic(bare) or not bare.endswith(".parquet"):
            selections.append((fs, bare))
    listed = {posixpath.dirname(path) for path in sizes}
    present, gone = set(shards), {}
    for url, (fs, base, entries) in indexes.items():
        for relative, entry in entries.items():
            bare = posixpath.join(base, relative)
            shard = to_url(fs, bare)
            if shard in present or bare in sizes or posixpath.dirname(bare) not in listed or "error" in entry:
                continue
            if any(fs.protocol == sel_fs.protocol and _selects(sel, bare) for sel_fs, sel in selections):
                gone[shard] = f"{shard}: listed in {url} but not in its folder (deleted after the index was written)"
    return gone


def _drop_stale(entries: dict[str, dict[str, Any]], sizes: dict[str, int], places: dict[str, Place]) -> list[str]:
    """Removes from `entries` the shards whose size differs from the index's record (changed since it was
    written), warning about them; returns what was found for each."""
    stale = []
    for shard, entry in list(entries.items()):
        size = sizes.get(places[shard][1])
        if size != entry["bytes"]:
            now = "not in its folder's listing" if size is None else f"{size} bytes"
            stale.append(f"{shard}: {now}, {entry['bytes']} bytes in {entry['index']}")
            del entries[shard]
    if stale:
        logger.warning(
            f"[data] {len(stale)} shards differ from the shard index (changed since it was written); reading "
            "their footers instead "
            f"(rebuild it: python -m data.index FOLDER): {'; '.join(stale[:5])}{'; ...' if len(stale) > 5 else ''}"
        )
    return stale


def _drop_undigested(entries: dict[str, dict[str, Any]]) -> None:
    """Removes from `entries` the shards an older index recorded without a footer digest: their footers are read."""
    undigested = [shard for shard, entry in entries.items() if "footer" not in entry and "error" not in entry]
    if undigested:
        logger.info(
            f"[data] the shard index records no footer digest for {len(undigested)} shards (written before they "
            f"were recorded, e.g. {entries[undigested[0]]['index']}): reading their footers; rebuilding it "
            "(python -m data.index FOLDER) makes start-up read no footers"
        )
    for shard in undigested:
        del entries[shard]


def _info(
    shard: str,
    entry: dict[str, Any] | None,
    footer: Footer | BadShardError | None,
    text_column: str,
    source_column: str,
) -> ShardInfo:
    """One shard's info from its index entry, else from its footer; a BadShardError if it is not usable."""
    if entry is not None:
        if "error" in entry:
            raise BadShardError(f"{shard}: {entry['error']} (recorded in {entry['index']})")
        check_columns(shard, map(tuple, entry["columns"]), text_column, source_column)
        return ShardInfo(shard, tuple(entry["row_groups"]), entry["bytes"], entry["footer"])
    if isinstance(footer, BadShardError):
        raise footer
    check_columns(shard, footer.columns, text_column, source_column)
    return ShardInfo(shard, footer.row_groups, footer.size, footer.digest)


def shard_infos(
    shards: list[str],
    text_column: str,
    source_column: str = "",
    on_bad_shard: str = "error",
    index: str | None = "",
    threads: int = FOOTER_THREADS,
    paths: list[str] | None = None,
) -> dict[str, ShardInfo]:
    """What `shard_info` gives for each usable shard (in the order given), from the index where it covers
    a shard of unchanged size with its footer digest, else from its footer; bad shards raise or are
    skipped as in `check_shards`. With the `paths` that listed them, a shard an index lists among them that is no
    longer there is a bad shard too, named: a deleted shard never leaves a run quietly short of it.

    `index`: "" finds `_index.json` in each shard's folder, a path names one index, None reads every footer."""
    entries: dict[str, dict[str, Any]] = {}
    sizes: dict[str, int] = {}
    places = locate_all(shards) if index is not None else {}
    if index is not None:
        sizes = folder_sizes(places, threads)
        for fs, _, folder in places.values():  # the listings are there: a glob's folders are checked too
            if posixpath.join(folder, PREPARING) in sizes:
                refuse_unfinished(to_url(fs, folder), [PREPARING])
        entries, indexes = _indexed_entries(places, sizes, index)
        gone = _gone(indexes, sizes, shards, paths) if paths else {}
    else:
        gone = {}
    missing = len(shards) - len(entries)
    stale = _drop_stale(entries, sizes, places)
    if missing and len(entries) + len(stale):
        logger.info(f"[data] {missing} of {len(shards)} shards not in a shard index: reading their footers")
    _drop_undigested(entries)
    unread = [shard for shard in shards if shard not in entries]
    footers = dict(zip(unread, read_footers(unread, threads), strict=True))
    infos: dict[str, ShardInfo] = {}
    problems: list[BadShardError | None] = []
    for shard in shards:
        problem = None
        try:
            infos[shard] = _info(shard, entries.get(shard), footers.get(shard), text_column, source_column)
        except BadShardError as e:
            problem = e
        problems.append(problem)
    problems += [BadShardError(problem) for problem in gone.values()]
    usable = settle_bad_shards([*shards, *gone], problems, on_bad_shard)
    return {shard: infos[shard] for shard in usable}


def infos_to_json(infos: dict[str, ShardInfo]) -> dict[str, Any]:
    """Shard infos as JSON-ready data (for a broadcast): {"shards": [[path, [rows, ...], size, footer], ...]}."""
    return {"shards": [[info.path, list(info.row_groups), info.size, info.footer] for info in infos.values()]}


def infos_from_json(data: dict[str, Any]) -> dict[str, ShardInfo]:
    """The inverse of `infos_to_json`, on every rank."""
    return {path: ShardInfo(path, tuple(groups), size, footer) for path, groups, size, footer in data["shards"]}


# -- sharing rank 0's answer --------------------------------------------------------------------


class Channel(Protocol):
    """How ranks exchange rank 0's answer: `broadcast(data)` takes rank 0's bytes (None elsewhere) and
    returns them on every rank."""

    rank: int

    def broadcast(self, data: bytes | None) -> bytes: ...


class TorchChannel:
    """A broadcast over the default process group: the length, then the UTF-8 bytes as uint8."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        backend = str(dist.get_backend())
        gpu = "nccl" in backend and "gloo" not in backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")

    def broadcast(self, data: bytes | None) -> bytes:
        size = torch.tensor([len(data or b"")], dtype=torch.int64, device=self.device)
        dist.broadcast(size, src=0)
        if data is not None:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device), src=0)
            return data
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(payload, src=0)
        return payload.cpu().numpy().tobytes()


# Errors raised on the other ranks as the type rank 0 raised; any other type arrives as a RuntimeError.
_SHARED_ERRORS = (BadShardError, NoDataError, BadIndexError, StoreError, FileNotFoundError, ValueError, TypeError)
_ERRORS: dict[str, type[Exception]] = {cls.__name__: cls for cls in (*_SHARED_ERRORS, OSError)}


def share_from_rank0(compute: Callable[[], dict], channel: Channel | None = None) -> dict:
    """Rank 0's `compute()` on every rank, sent as JSON text; an error on rank 0 is raised on every rank.

    Without a channel: the default process group when one is initialised with several ranks, else
    `compute()` is simply called. Every rank must call it (a collective)."""
    if channel is None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return compute()
        channel = TorchChannel()
    if channel.rank != 0:
        answer = json.loads(channel.broadcast(None).decode("utf-8"))
        if "error" in answer:
            kind = _ERRORS.get(answer["error"], RuntimeError)
            raise kind(f"{answer['message']} [raised on rank 0: {answer['error']}]")
        return answer["value"]
    failure: Exception | None = None
    try:
        text = json.dumps({"value": compute()}, ensure_ascii=False)
    except Exception as e:  # any failure must reach the other ranks, or they wait for ever
        failure = e
        text = json.dumps({"error": type(e).__name__, "message": str(e)}, ensure_ascii=False)
    channel.broadcast(text.encode("utf-8"))
    if failure is not None:
        raise failure
    return json.loads(text)["value"]


def startup_shards(
    paths: list[str],
    manifest: str,
    text_column: str,
    source_column: str,
    on_bad_shard: str,
    index: str | None = "",
    channel: Channel | None = None,
) -> dict[str, ShardInfo]:
    """The usable shards, their row groups, sizes and footer digests, listed and checked on rank 0 alone and
    shared with every rank: what a loader needs at start-up, in a few requests where an index covers the corpus."""

    def compute() -> dict[str, Any]:
        shards = list_shards(paths, manifest)
        listed_by = None if manifest else paths  # a manifest names every shard itself: a missing one fails its listing
        return infos_to_json(shard_infos(shards, text_column, source_column, on_bad_shard, index, paths=listed_by))

    return infos_from_json(share_from_rank0(compute, channel))


# -- command line -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Write a shard index (_index.json) for an existing parquet corpus, so every rank's "
        "start-up reads one file instead of every footer."
    )
    parser.add_argument("shards", nargs="+", help="folders, globs or paths of parquet shards (local or fsspec URLs)")
    parser.add_argument(
        "--out",
        default="",
        help="one index for all shards, at this path (below which every shard must lie); default: "
        f"{INDEX_NAME} in each folder that holds shards, where the loader finds it by itself",
    )
    parser.add_argument("--threads", type=int, default=FOOTER_THREADS, help="footers read at once")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("data").setLevel(logging.INFO)  # ours, not botocore's line per credential lookup
    try:  # bad input (nothing there, an unfinished folder, a shard outside --out, a failing store): one line
        groups: dict[str, list[str]] = {}
        for shard in list_shards(args.shards):
            groups.setdefault(args.out or posixpath.join(posixpath.dirname(shard), INDEX_NAME), []).append(shard)
        for out, members in groups.items():
            written = write_index(members, out, args.threads)
            groups_written = sum(len(entry.get("row_groups", [])) for entry in written["shards"])
            print(f"{out}: {len(members)} shards, {groups_written} row groups")
            for entry in (entry for entry in written["shards"] if "error" in entry):
                print(f"  unreadable (stopped or skipped, per on_bad_shard): {entry['path']}: {entry['error']}")
    except (ValueError, OSError) as e:
        sys.exit(f"python -m data.index: {e}")


if __name__ == "__main__":
    main()
