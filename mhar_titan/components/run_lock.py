"""One job per run folder: `<dump_folder>/run.lock`, held by the job's rank 0 while it runs.

Two jobs on one folder overwrite each other's checkpoints, fingerprint and TensorBoard events, and
SLURM can start a requeued job while the old one is still writing its last checkpoint. flock is
local to a host (or unsupported) on many NFS and Lustre mounts; an exclusive create (O_CREAT |
O_EXCL) is atomic on both. So the lock is a file created exclusively, holding who owns it (host,
PID and its start time, the launch and SLURM job ids) and a heartbeat that a daemon thread
rewrites in place every `stale_after / 10` seconds while the job lives.

A job that finds the lock:
- takes it over when its holder is gone: the heartbeat is older than `stale_after` seconds, or the
  holder ran on this host and its process no longer exists; the log says which;
- waits, up to `wait` seconds, when the holder is an earlier run of this same SLURM job (a requeue
  that started while the old job was still checkpointing);
- refuses otherwise, naming the holder.
A takeover renames the old lock aside before creating its own, so two jobs taking over at once
cannot both win. The live job writes its heartbeat through its own open file: after a takeover
its writes land in the renamed file, never in the new holder's, and it sees the lock is lost.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from data.atomic import pid_alive, process_start
from mhar_titan.components.exit_codes import LOCK_LOST

LOCK_FILE = "run.lock"


def identity() -> dict[str, Any]:
    """Who this process is, for the lock and for messages."""
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "pid_start": process_start(pid),
        "launch_id": os.environ.get("MHAR_LAUNCH_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or "",
        "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""),
        "slurm_restart": os.environ.get("SLURM_RESTART_COUNT", ""),
    }


def describe(holder: dict[str, Any]) -> str:
    job = f", SLURM job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    launch = f", launch {holder['launch_id']}" if holder.get("launch_id") else ""
    return f"host {holder.get('host')}, pid {holder.get('pid')}{job}{launch}"


class LockHeld(RuntimeError):
    """Another live job holds the run folder."""


class RunLock:
    """`acquire` once (returns a line for the log); `lost` turns true once a heartbeat finds the lock
    taken over; `release` at exit. `clock`/`sleep` are injectable for tests."""

    def __init__(
        self,
        folder: str,
        stale_after: float,
        wait: float,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        me: dict[str, Any] | None = None,
    ):
        if not stale_after > 0:
            raise ValueError(f"[job] run_lock_stale_s = {stale_after} must be > 0")
        if wait < 0:
            raise ValueError(f"[job] run_lock_wait_s = {wait} must be >= 0")
        self.folder, self.path = folder, os.path.join(folder, LOCK_FILE)
        self.stale_after, self.wait = stale_after, wait
        self.clock, self.sleep = clock, sleep
        self.me = {**(me or identity()), "token": uuid.uuid4().hex}
        self.fd: int | None = None
        self.lost = False
        self._beats = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._write_lock = threading.Lock()

    # -- reading a lock -----------------------------------------------------------------------

    def _read(self, path: str | None = None) -> dict[str, Any] | None:
        """The holder's record, None when there is no lock; a record caught mid-rewrite is read again."""
        path = path or self.path
        for attempt in range(5):
            try:
                with open(path) as f:
                    text = f.read()
            except FileNotFoundError:
                return None
            try:
                holder = json.loads(text)
                if isinstance(holder, dict) and "token" in holder:
                    return holder
            except ValueError:
                pass
            self.sleep(0.05 * (attempt + 1))
        return {"token": None, "unreadable": text[:200]}

    def verdict(self, holder: dict[str, Any]) -> tuple[str, str]:
        """("take", why) when the holder is gone, ("wait", why) for an earlier run of this SLURM job,
        ("refuse", why) otherwise."""
        if holder.get("token") is None:
            return "take", f"unreadable lock ({holder.get('unreadable')!r})"
        age = self.clock() - float(holder.get("heartbeat", 0))
        who = describe(holder)
        if age > self.stale_after:
            return "take", f"its heartbeat is {age:.0f} s old (> [job] run_lock_stale_s = {self.stale_after:g}): {who}"
        if holder.get("host") == self.me["host"] and not pid_alive(int(holder.get("pid", 0)), holder.get("pid_start")):
            return "take", f"its process is gone: {who}"
        fresh = f"{who}, last heartbeat {max(age, 0):.0f} s ago"
        if self.me["slurm_job_id"] and holder.get("slurm_job_id") == self.me["slurm_job_id"]:
            return "wait", f"an earlier run of this SLURM job still holds it ({fresh})"
        return "refuse", fresh

    # -- taking it ----------------------------------------------------------------------------

    def _record(self) -> bytes:
        now = self.clock()
        self._beats += 1
        record = {**self.me, "heartbeat": now, "beats": self._beats}
        if self._beats == 1:
            self.me["started"] = now
            record["started"] = now
        return (json.dumps(record) + "\n").encode()

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        os.write(fd, self._record())
        os.fsync(fd)
        self.fd = fd
        return True

    def _take_over(self, holder: dict[str, Any]) -> bool:
        """Rename the gone holder's lock aside, if it is still that one; False when someone was faster."""
        aside = f"{self.path}.taken-{self.me['token']}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        moved = self._read(aside)
        if moved is not None and moved.get("token") != holder.get("token"):
            # A new holder's lock, created after we read the old one: give it back untouched.
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            os.unlink(aside)
            return False
        os.unlink(aside)
        return True

    def try_acquire(self) -> tuple[str, str]:
        """One attempt: ("acquired", log line), ("wait", why) or ("refuse", why)."""
        os.makedirs(self.folder, exist_ok=True)
        taken = ""
        for _ in range(10):
            if self._create():
                self._start_heartbeat()
                line = f"{self.path}: this job holds the run folder ({describe(self.me)})"
                return "acquired", line + (f"; took over a lock whose job is gone: {taken}" if taken else "")
            holder = self._read()
            if holder is None:
                continue  # released between the create and the read
            kind, why = self.verdict(holder)
            if kind != "take":
                return kind, why
            if self._take_over(holder):
                taken = why
        return "refuse", "the lock changed hands ten times while this job tried to take it"

    def refusal(self, why: str) -> str:
        return (
            f"{self.path}: the run folder is in use by another job ({why}); two jobs on one run folder would "
            "overwrite each other's checkpoints. Stop that job or use another dump_folder. A lock whose job died "
            f"on another host is taken over once its heartbeat is older than [job] run_lock_stale_s = "
            f"{self.stale_after:g} s"
        )

    def attempt(self, deadline: float) -> dict[str, str]:
        """One attempt before `deadline`: {"kind": "acquired", "line": log line}, {"kind": "wait"} (after
        sleeping one poll), or {"kind": "refuse", "line": the refusal}."""
        kind, why = self.try_acquire()
        if kind == "wait" and self.clock() >= deadline:
            kind, why = "refuse", f"{why}; waited {self.wait:g} s ([job] run_lock_wait_s)"
        if kind == "wait":
            self.sleep(min(5.0, max(0.1, self.wait / 20)))
        return {"kind": kind, "line": self.refusal(why) if kind == "refuse" else why}

    def acquire(self) -> str:
        """Acquire, waiting up to `wait` seconds for an earlier run of this SLURM job; LockHeld otherwise."""
        return acquire_everywhere(self, lambda attempt: attempt())

    # -- holding it ---------------------------------------------------------------------------

    def _start_heartbeat(self) -> None:
        interval = min(30.0, max(0.2, self.stale_after / 10))
        self._thread = threading.Thread(target=self._beat_until_stopped, args=(interval,), daemon=True)
        self._thread.start()

    def _beat_until_stopped(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.heartbeat()

    def heartbeat(self) -> None:
        """Rewrite the record in place, through our own descriptor; notice when the lock is no longer ours."""
        with self._write_lock:
            if self.fd is None:
                return
            data = self._record()
            os.pwrite(self.fd, data, 0)
            os.ftruncate(self.fd, len(data))
            if not self.still_ours():
                self.lost = True

    def still_ours(self) -> bool:
        if self.fd is None:
            return False
        try:
            return os.stat(self.path).st_ino == os.fstat(self.fd).st_ino
        except FileNotFoundError:
            return False

    def release(self) -> None:
        """Stop the heartbeat and remove the lock, only if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._write_lock:
            if self.fd is None:
                return
            if self.still_ours():
                os.unlink(self.path)
            os.close(self.fd)
            self.fd = None


def acquire_everywhere(lock: RunLock | None, share: Callable[[Callable[[], dict]], dict]) -> str:
    """Every rank of a job calls this; rank 0 holds `lock`, the others pass None and follow its verdict,
    which `share(compute)` sends from rank 0 to all. A wait is a series of short polls, each shared, so
    no rank sits in one collective for longer than a poll. Returns the log line; LockHeld on refusal."""
    deadline = lock.clock() + lock.wait if lock is not None else 0.0
    while True:
        verdict = share(lambda: lock.attempt(deadline))
        if verdict["kind"] == "acquired":
            return verdict["line"]
        if verdict["kind"] == "refuse":
            raise LockHeld(verdict["line"])


class LockLost(SystemExit):
    """A job stops with it once another job has taken its run folder over: it writes nothing more there (not even a
    crash record), and its launcher does not start it again (exit LOCK_LOST)."""

    def __init__(self, step: int, dump_folder: str):
        super().__init__(LOCK_LOST)
        self.line = (
            f"step {step}: {os.path.join(dump_folder, LOCK_FILE)} was taken over by another job (this job's "
            "heartbeat had stalled past [job] run_lock_stale_s); stopping without writing anything more to the run "
            f"folder (exit {LOCK_LOST})"
        )
