"""Where shards lie: each shard's filesystem, bare path and folder, and one listing per folder.

Start-up lists each folder once (sizes in bytes, and whether an `_index.json` is there) instead of
asking about every shard: thousands of shards on an object store, every rank.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from data.store import StoreError, filesystem, store_call

logger = logging.getLogger(__name__)

Place = tuple[Any, str, str]  # (filesystem, path without protocol, its folder)


def locate(path: str) -> Place:
    """What listings and relative paths are keyed by."""
    fs, bare = filesystem(path)
    return fs, bare, fs._parent(bare)


def locate_all(paths: list[str]) -> dict[str, Place]:
    """`locate` of many paths, the filesystem looked up once per protocol (thousands of shards, every rank)."""
    filesystems: dict[str, Any] = {}
    places = {}
    for path in paths:
        protocol = path.split("://", 1)[0] if "://" in path else ""
        if "::" in path:  # a chained URL: no shortcut
            places[path] = locate(path)
            continue
        if protocol not in filesystems:
            filesystems[protocol] = filesystem(path)[0]
        fs = filesystems[protocol]
        bare = fs._strip_protocol(path)
        places[path] = (fs, bare, fs._parent(bare))
    return places


def folder_sizes(places: dict[str, Place], threads: int) -> dict[str, int]:
    """Size in bytes of every file in the folders of `places`, keyed by protocol-less path: one `ls`
    per folder. A folder that cannot be listed is left out (its shards then read their footers); a store that
    cannot be read is a StoreError."""
    folders: dict[tuple[int, str], Any] = {}
    for fs, _, folder in places.values():
        folders[(id(fs), folder)] = fs

    def listing(key: tuple[int, str]) -> dict[str, int]:
        fs = folders[key]
        try:
            entries = store_call(to_url(fs, key[1]), "listing", partial(fs.ls, key[1], detail=True))
        except StoreError:
            raise
        except OSError as e:
            logger.warning(f"[data] cannot list {key[1]} ({type(e).__name__}: {e}): reading its shards' footers")
            return {}
        return {e["name"]: int(e["size"]) for e in entries if e.get("type") == "file"}

    sizes: dict[str, int] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(folders)))) as pool:
        for found in pool.map(listing, folders):
            sizes.update(found)
    return sizes


def to_url(fs: Any, bare: str) -> str:
    """A protocol-less path as a URL fsspec opens (plain for local files)."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol
    return bare if "file" in protocols else fs.unstrip_protocol(bare)
