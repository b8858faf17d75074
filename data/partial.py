"""Outputs built in a hidden sibling folder and renamed into place once complete, and the siblings that
killed writers leave behind.

A sibling is named for its output, its kind, and its writer's PID and host: `.OUT.KIND-PID@HOST`. A
later writer to the same output can then tell a killed writer's folder (this host, a process that is
gone: removed, and said) from a live writer's (kept) or another host's (kept, and mentioned), and it
touches nothing else. data.prepare and the HF export and init use it; the run lock asks `pid_alive`.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from collections.abc import Callable

HOST = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())


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
