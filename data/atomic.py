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
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable

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
