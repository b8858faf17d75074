"""Where data.prepare puts its output: a local or shared folder, built beside OUT_DIR and renamed into place, or
a prefix on object storage (`s3://`, `gs://`), which has no rename and so is written the object-store way.

On object storage a run first creates `_PREPARING.json` there, exclusively (a conditional write: a second run
to the same prefix is refused), uploads each shard as it closes (local disk holds one shard at a time), then
`_index.json`, `manifest.txt` and `summary.json`, and deletes the marker last. The loader refuses a folder
that holds the marker (data/shards.py), so no job trains on part of a corpus. `--overwrite` deletes the
earlier output, summary first, before writing the new one: object storage cannot swap them in one step.
A run that fails deletes what it wrote and its marker; a killed one leaves the marker, which names its
process and host, and the next `--overwrite` run from that host removes the leftovers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path

from fsspec.core import url_to_fs

from data.atomic import HOST, pid_alive, sibling
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
    foreign = [name for name in entries if not OURS.fullmatch(name) and name != PREPARING]
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


# -- object storage: a marker written first and deleted last ---------------------------------------------


class RemoteOutput:
    """OUT_DIR on object storage. `claim` before anything is written there, `upload` each finished file,
    `finish` once all are up; `abandon` removes this run's files after a failure."""

    def __init__(self, url: str):
        self.url = url
        self.fs, self.root = url_to_fs(url)
        self.uploaded: list[str] = []
        self.claimed = False

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def name_url(self, name: str) -> str:
        return f"{self.url}/{name}"

    def listing(self) -> list[str]:
        try:
            entries = self.fs.ls(self.root, detail=True, refresh=True)
        except FileNotFoundError:
            return []
        except Exception as e:  # noqa: BLE001  the store's first answer: a missing bucket, no credentials (botocore's own type)
            raise PrepareError(f"{self.url}: cannot list it ({type(e).__name__}: {e})") from e
        return sorted(os.path.basename(e["name"].rstrip("/")) + ("/" if e["type"] == "directory" else "")
                      for e in entries)  # fmt: skip

    def check(self, overwrite: bool) -> None:
        """Refuse a prefix that holds anything else, or our earlier output without --overwrite, or a run's
        marker unless this host's run that wrote it is gone."""
        entries = self.listing()
        if PREPARING in entries:
            self._check_marker(overwrite)
        check_entries(self.url, entries, overwrite)

    def _check_marker(self, overwrite: bool) -> None:
        marker = self.name_url(PREPARING)
        try:
            owner = json.loads(self.fs.cat_file(self.path(PREPARING)))
            pid, host, started = int(owner["pid"]), str(owner["host"]), str(owner["started"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise PrepareError(f"{marker}: a data.prepare marker that cannot be read ({e}); delete it if no run "
                               "writes this prefix, then rerun with --overwrite") from e  # fmt: skip
        who = f"PID {pid} on host {host}, started {started}"
        if host == HOST and pid != os.getpid() and pid_alive(pid):
            raise PrepareError(f"{self.url}: being written by data.prepare ({who})")
        if host != HOST:
            raise PrepareError(f"{self.url}: written by data.prepare ({who}), which has not finished; if that run "
                               f"is gone, delete {marker} and rerun with --overwrite")  # fmt: skip
        if not overwrite:
            raise PrepareError(f"{self.url}: left incomplete by a killed data.prepare ({who}); rerun with --overwrite")
        say(f"{self.url}: removing the incomplete output of a killed data.prepare ({who})")
        self.fs.rm_file(self.path(PREPARING))

    def claim(self) -> None:
        """The marker, created only if no other run has created it since `check` (a conditional write)."""
        owner = {"pid": os.getpid(), "host": HOST, "fqdn": socket.getfqdn(),
                 "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
        try:
            with self.fs.open(self.path(PREPARING), "xb") as f:
                f.write(json.dumps(owner).encode())
        except FileExistsError as e:
            raise PrepareError(f"{self.url}: another data.prepare run began writing it just now") from e
        except (OSError, ValueError, NotImplementedError) as e:
            raise PrepareError(f"{self.url}: cannot create {PREPARING} there ({type(e).__name__}: {e})") from e
        self.claimed = True

    def clear_old(self) -> None:
        """Delete an earlier output, its summary first: from then on it no longer reads as complete."""
        names = [n for n in self.listing() if OURS.fullmatch(n)]
        for name in sorted(names, key=lambda n: (n != "summary.json", n != "manifest.txt", n)):
            self.fs.rm_file(self.path(name))
        if names:
            say(f"{self.url}: deleted the earlier output ({len(names)} files)")

    def upload(self, local: Path) -> None:
        """Put one finished file there and free its local copy."""
        self.fs.put_file(str(local), self.path(local.name))
        self.uploaded.append(local.name)
        local.unlink()

    def finish(self) -> None:
        self.fs.rm_file(self.path(PREPARING))
        self.claimed = False

    def abandon(self) -> None:
        """After a failure: delete this run's files, then its marker; what cannot be deleted is said."""
        if not self.claimed:
            return
        try:
            for name in self.uploaded:
                self.fs.rm_file(self.path(name))
            self.fs.rm_file(self.path(PREPARING))
        except OSError as e:
            say(f"{self.url}: could not delete this run's partial output ({e}); its {PREPARING} stays, so no "
                "job reads it: rerun with --overwrite")  # fmt: skip
