"""Files and folders that appear whole or not at all, the one implementation of both (here, below mhar_titan,
because data.prepare writes its output folders with it too).

- `write_text`: a small file that others read while it runs (fingerprints, checksums, markers, validation
  records, run records, reports), written to a unique temporary beside it, fsynced, then renamed over it.
- `sibling` and `clean_stale`: an output folder built in a hidden sibling and renamed into place by its
  writer once complete (data.prepare, the HF export and init), and the siblings that killed writers leave.
  A sibling is named for its output, its kind, and its writer's PID and host: `.OUT.KIND-PID@HOST`. A later
  writer to the same output can then tell a killed writer's folder (this host, a process that is gone:
  removed, and said) from a live writer's (kept) or another host's (kept, and mentioned), and it touches
  nothing else. The run lock asks `pid_alive`.
- `RemoteFolder`: the same promise on object storage, which has no rename: a marker created exclusively first
  and deleted last (data.prepare's corpora and HF exports on `s3://`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable

from data.store import StoreError, create_exclusive, filesystem, objects, remove_prefix, store_call

HOST = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` to a temporary file beside `path`, fsync it, then rename it over `path`. A reader sees the
    old file or the new one, never a part; a crash leaves the old one; two writers never share a temporary."""
    folder = os.path.dirname(os.fspath(path)) or "."
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(os.fspath(path))}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes 0600: the mode `open` would have given, for teammates
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def umask() -> int:
    """The process umask, read without changing it where Linux shows it (/proc/self/status)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (racy only against threads creating files now)
    os.umask(mask)
    return mask


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), which tells a reused PID apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def pid_alive(pid: int, start: int | None = None) -> bool:
    """Whether process `pid` runs on this host (another user's counts); with `start`, only if it is the
    process that started then, not a later one given the same PID."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return start is None or process_start(pid) in (None, start)


def sibling(out: str, kind: str) -> str:
    """This process's hidden folder of `kind` beside `out`."""
    parent, name = os.path.split(os.path.abspath(out))
    return os.path.join(parent, f".{name}.{kind}-{os.getpid()}@{HOST}")


def clean_stale(
    out: str,
    kinds: tuple[str, ...],
    what: str,
    log: Callable[[str], None],
    keep: Callable[[str], str | None] = lambda kind: None,
) -> None:
    """Before this process makes its own: remove the `kinds` siblings of `out` whose writer on this host
    is gone, saying so; mention those of other hosts; keep those of live writers, and those for which
    `keep(kind)` gives a reason. A folder with this process's own PID was left by an earlier process
    that had it. `what` names the tool in messages."""
    parent, name = os.path.split(os.path.abspath(out))
    ours = re.compile(rf"\.{re.escape(name)}\.({'|'.join(map(re.escape, kinds))})-(\d+)@([A-Za-z0-9._-]+)")
    for entry in sorted(os.listdir(parent)) if os.path.isdir(parent) else []:
        path = os.path.join(parent, entry)
        m = ours.fullmatch(entry)
        if not m or os.path.islink(path) or not os.path.isdir(path):
            continue
        kind, pid, host = m[1], int(m[2]), m[3]
        folder = f"a temporary folder of {what} {os.path.join(parent, name)}"
        if host != HOST:
            log(f"{path}: {folder} by PID {pid} on host {host}; left in place (remove it once that run is gone)")
        elif pid != os.getpid() and pid_alive(pid):
            log(f"{path}: {folder} being written by PID {pid} on this host; left in place")
        elif reason := keep(kind):
            log(f"{path}: {folder}, {reason}; left in place")
        else:
            shutil.rmtree(path)
            gone = "an earlier process with this PID" if pid == os.getpid() else "which is gone"
            log(f"removed {path}: {folder} left by PID {pid} on this host, {gone}")


# -- object storage: no rename, so a marker created first and deleted last ---------------------------------


class OutputError(ValueError):
    """An output on object storage that cannot be written; the message names the URL and why."""


class RemoteFolder:
    """An output folder on object storage (`s3://bucket/prefix`), written without renames: `claim` creates the
    `marker` only if no other writer has (a conditional write), `upload` puts each finished file, `finish`
    deletes the marker last; `abandon` removes this writer's files after a failure. A writer killed midway
    leaves the marker, naming its PID and host: `check` refuses the folder then, unless that process was on
    this host and is gone and `replace` is allowed (its leftovers are then the caller's to replace). `tool`
    names the writer in messages."""

    def __init__(self, url: str, marker: str, tool: str, redo: str = "rerun with --overwrite"):
        self.url, self.marker, self.tool, self.redo = url.rstrip("/"), marker, tool, redo
        self.fs, self.root = filesystem(self.url)
        self.uploaded: list[str] = []
        self.claimed = False

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def name_url(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _store(self, what: str, call: Callable[[], object], name: str = "") -> object:
        return store_call(self.name_url(name) if name else self.url, what, call)

    def listing(self) -> list[str]:
        """The objects below the folder (paths relative to it), read fresh; [] if none (folder entries are not
        objects). A bucket that is not there is a StoreError, here, before any work."""
        return self._store("listing", lambda: objects(self.fs, self.root))  # type: ignore[return-value]

    def check(self, replace: bool, log: Callable[[str], None]) -> list[str]:
        """The folder's entries after the marker of a killed writer of this host is removed (with `replace`);
        raises on any other writer's marker."""
        entries = self.listing()
        if self.marker not in entries:
            return entries
        marker = self.name_url(self.marker)
        try:
            owner = json.loads(self.fs.cat_file(self.path(self.marker)))
            pid, host, started = int(owner["pid"]), str(owner["host"]), str(owner["started"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise OutputError(
                f"{marker}: a {self.tool} marker that cannot be read ({e}); delete it if no run writes this folder"
            ) from e
        who = f"PID {pid} on host {host}, started {started}"
        if host == HOST and pid != os.getpid() and pid_alive(pid):
            raise OutputError(f"{self.url}: being written by {self.tool} ({who})")
        if host != HOST:
            raise OutputError(
                f"{self.url}: written by {self.tool} ({who}), which has not finished; if that run "
                f"is gone, delete {marker} and rerun"
            )
        if not replace:
            raise OutputError(f"{self.url}: left incomplete by a killed {self.tool} ({who}); {self.redo}")
        log(f"{self.url}: removing the incomplete output of a killed {self.tool} ({who})")
        self.fs.rm_file(self.path(self.marker))
        return [e for e in entries if e != self.marker]

    def claim(self) -> None:
        """The marker, created only if no other writer has created it since `check` (a conditional write)."""
        owner = {
            "pid": os.getpid(),
            "host": HOST,
            "fqdn": socket.getfqdn(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        data = json.dumps(owner).encode()
        try:
            self._store(f"creating {self.marker}", lambda: create_exclusive(self.fs, self.path(self.marker), data))
        except FileExistsError as e:
            raise OutputError(f"{self.url}: another {self.tool} began writing it just now") from e
        except StoreError:
            raise
        except (OSError, ValueError, NotImplementedError) as e:
            raise OutputError(f"{self.url}: cannot create {self.marker} there ({type(e).__name__}: {e})") from e
        self.claimed = True

    def delete(self, names: list[str]) -> None:
        for name in names:
            self._store("deleting it", lambda name=name: self.fs.rm_file(self.path(name)), name)

    def upload(self, local: str, name: str | None = None, keep: bool = False) -> None:
        """Put one finished file there (as `name`, default its own) and, unless `keep`, free its local copy."""
        name = name or os.path.basename(local)
        self._store("uploading it", lambda: self.fs.put_file(local, self.path(name)), name)
        self.uploaded.append(name)
        if not keep:
            os.unlink(local)

    def finish(self) -> None:
        self.delete([self.marker])
        self.claimed = False

    def abandon(self, log: Callable[[str], None]) -> None:
        """After a failure: delete this writer's files, then its marker, then the folder entries they leave on
        some servers (an empty prefix then lists nothing); what cannot be deleted is said."""
        if not self.claimed:
            return
        try:
            self.delete(self.uploaded)
            self.delete([self.marker])
            self._store("removing it", lambda: remove_prefix(self.fs, self.root, []))
        except OSError as e:
            log(f"{self.url}: could not delete this run's partial output ({e}); its {self.marker} stays: {self.redo}")
