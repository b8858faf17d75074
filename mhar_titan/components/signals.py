"""The signals a cluster sends to every process of a job, and the processes that must live through them.

Slurm's scancel, `scontrol requeue`, a time limit and a preemption send SIGTERM to every process of the job's
steps, one by one (not to a process group): the launcher, torchrun's agent, the workers and the processes the
workers started. Only the workers should act on it, by checkpointing at their next step boundary
(components/preemption.py). The others keep going until the workers are done:

- torchrun's agent by default takes SIGTERM as "shut the workers down" (SIGTERM to them, SIGKILL 30 s later, a
  traceback and exit 1) and dies of SIGUSR1. `agent_passes_signals` makes it hand both to its workers and keep
  waiting for their exit code.
- torch's checkpoint process (`async_mode = "async_with_pinned_mem"`) dies of SIGTERM mid-save, and the stop's
  checkpoint then fails ("Checkpoint background process is dead"). Threads and processes started under
  `shielded()` hold these signals blocked (a process inherits its thread's mask through fork and exec), so the
  save goes on and the stop waits for it; at exit they are ended with SIGKILL, which nothing blocks.

Stdlib only: the launcher imports it before torch.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import resource_tracker

CLUSTER_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # what a scheduler sends to ask for a checkpoint and a stop
_exit_armed = False


def children_of(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (Linux /proc; empty elsewhere)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
        if len(fields) > 1 and fields[1] == str(pid):
            found.append(int(entry))
    return found


def _pass_on(signum: int, _frame: object) -> None:
    name = signal.Signals(signum).name
    workers = children_of(os.getpid())
    for pid in workers:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    said = f"mhar_titan.launch: got {name}; passed to the {len(workers)} workers, which checkpoint and stop"
    print(said, file=sys.stderr)


def agent_passes_signals(shutdown_signals: str) -> str:
    """In torchrun's agent, before it starts the workers: SIGTERM and SIGUSR1 go on to the workers (once more, where
    the cluster sent them too) and the agent waits for their exit, however long their checkpoint takes. Returns
    torchrun's `--signals-to-handle` list (its shutdown signals) without them: Ctrl-C still stops everything."""
    for sig in CLUSTER_SIGNALS:
        signal.signal(sig, _pass_on)
    ours = {sig.name for sig in CLUSTER_SIGNALS}
    return ",".join(name for name in shutdown_signals.split(",") if name.strip() not in ours)


def _end_shielded() -> None:
    """At exit, before multiprocessing's own exit handler (which ends daemon children with SIGTERM, blocked in the
    shielded ones, then waits for them): SIGKILL. The saves they served were waited for by then, or the job is
    failing and an unfinished save stays incomplete (its `.metadata` is written last)."""
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join(timeout=10)


@contextmanager
def shielded() -> Iterator[None]:
    """Threads and processes started inside hold CLUSTER_SIGNALS blocked for good; this thread blocks them only
    inside (one that arrives meanwhile waits, it is not lost)."""
    global _exit_armed
    # multiprocessing starts its resource tracker at the first spawn and then unblocks SIGTERM in the spawning
    # thread (bpo-33613, multiprocessing/resource_tracker.py): started now, it leaves the mask alone.
    resource_tracker.ensure_running()
    if not _exit_armed:
        atexit.register(_end_shielded)  # after multiprocessing's, so it runs first
        _exit_armed = True
    before = signal.pthread_sigmask(signal.SIG_BLOCK, CLUSTER_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
