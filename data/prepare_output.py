"""Where data.prepare puts its output: a local or shared folder, built beside OUT_DIR and renamed into place, or
a prefix on object storage (`s3://`, `gs://`), which has no rename and so is written the object-store way.

On object storage a run first creates `_PREPARING.json` there, exclusively (a conditional write: a second run
to the same prefix is refused), uploads each shard as it closes (local disk holds one shard at a time), then
`_index.json`, `manifest.txt` and `summary.json`, and deletes the marker last. The loader refuses a folder
that holds the marker (data/shards.py), so no job trains on part of a corpus. `--overwrite` deletes the
earlier output, summary first, before writing the new one: object storage cannot swap them in one step.
A run that fails deletes what it wrote and its marker; a killed one leaves the marker, which names its
process and host, and the next `--overwrite` run from that host removes the leftovers. The marker protocol
is data/atomic.py's RemoteFolder, which HF exports share.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from pathlib import Path

from data.atomic import RemoteFolder, sibling
from data.atomic import clean_stale as clean_stale_siblings
from data.index import INDEX_NAME
from data.shards import PREPARING

OURS = re.compile(r"shard-\d{5,}\.parquet|manifest\.txt|summary\.json|" + re.escape(INDEX_NAME))


class PrepareError(Exception):
    """A run that cannot go on; the message says why, naming the file or option."""


def is_url(value: str) -> bool:
    return "://" in value


def out_dir(value: str) -> str:
    """OUT_DIR as given: a local path, or a URL of object storage (never a local folder named `s3:`)."""
    if is_url(value) and not value.split("://", 1)[1].strip("/"):
        raise argparse.ArgumentTypeError(f"{value}: a URL needs a bucket and a prefix, e.g. s3://bucket/corpus")
    return value.rstrip("/") if is_url(value) else value


def say(line: str) -> None:
    print(line, file=sys.stderr)


# -- a local or shared folder: built beside OUT_DIR, renamed into place ---------------------------------


def check_out_dir(out: Path, overwrite: bool, inputs: list[str]) -> None:
    """OUT_DIR must be new, empty or (with --overwrite) an earlier output, and outside the input folders."""
    if out.exists() and not out.is_dir():
        raise PrepareError(f"{out}: exists and is not a folder")
    entries = sorted(p.name for p in out.iterdir()) if out.exists() else []
    check_entries(str(out), entries, overwrite)
    resolved = out.resolve()
    for arg in inputs:
        folder = Path(arg).resolve()
        if folder.is_dir() and resolved.is_relative_to(folder):
            raise PrepareError(f"{out}: inside the input folder {arg}; a later run would read its shards as input")


def check_entries(out: str, entries: list[str], overwrite: bool) -> None:
    if entries and not overwrite:
        raise PrepareError(f"{out}: not empty ({len(entries)} entries, e.g. {entries[0]}); pass --overwrite to replace")
    foreign = [name for name in entries if not OURS.fullmatch(name)]  # a remote marker: RemoteFolder.check
    if foreign:
        raise PrepareError(
            f"{out}: holds files data.prepare does not write ({', '.join(foreign[:5])}); refusing to replace it"
        )


def clean_stale(out: Path) -> None:
    """Remove the temporary folders (`partial`: an output being built; `old`: the output it replaced) of
    runs to `out` whose process on this host is gone, saying so (data/atomic.py). An `old` folder is
    kept while `out` is missing: it may hold the only copy of the previous output."""

    def keep(kind: str) -> str | None:
        return (
            f"the earlier output, moved aside before {out} was replaced" if kind == "old" and not out.exists() else None
        )

    clean_stale_siblings(str(out), ("partial", "old"), "python -m data.prepare", say, keep)


def commit(partial: Path, out: Path) -> None:
    """Put the finished folder in place: the old output (if any) moves aside first, then goes."""
    if out.exists():
        old = Path(sibling(str(out), "old"))
        os.rename(out, old)
        os.rename(partial, out)
        shutil.rmtree(old)
    else:
        os.rename(partial, out)


# -- object storage (data/atomic.py RemoteFolder: a marker created first and deleted last) ---------------------


def remote_output(url: str, overwrite: bool) -> RemoteFolder:
    """OUT_DIR on object storage, checked as a folder is: new, empty, or (with --overwrite) an earlier output."""
    remote = RemoteFolder(url, PREPARING, "data.prepare")
    check_entries(url, remote.check(overwrite, say), overwrite)
    return remote


def clear_old(remote: RemoteFolder) -> None:
    """Delete an earlier output, its summary first: from then on it no longer reads as complete."""
    names = [n for n in remote.listing() if OURS.fullmatch(n)]
    remote.delete(sorted(names, key=lambda n: (n != "summary.json", n != "manifest.txt", n)))
    if names:
        say(f"{remote.url}: deleted the earlier output ({len(names)} files)")
