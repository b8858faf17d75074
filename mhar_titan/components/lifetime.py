"""Workers die with the torchrun agent that started them, whatever killed it (SIGKILL included).

torchrun's agent starts each worker in a session of its own (`start_new_session=True` in
torch/distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py,
`SubprocessHandler._popen`), so a scheduler that SIGKILLs the launcher's process group kills the
agent but not the workers: they keep training and writing checkpoints, and a requeued job can
overlap with them. `die_with_parent` asks Linux for SIGKILL when the parent dies
(`prctl(PR_SET_PDEATHSIG, SIGKILL)`).

Why SIGKILL, not SIGTERM: a worker that catches SIGTERM lingers to checkpoint at the next step
boundary, and that checkpoint could race with the requeued job that is already resuming from the
same folder. An agent that dies in an orderly way still stops its workers with SIGTERM first
(`PContext.close`); this signal is only for an agent that cannot.

PR_SET_PDEATHSIG follows the parent *thread*: the signal fires when the thread that forked the
worker exits, even if the agent process lives on. torchrun forks from its main thread:
`torch.distributed.run` -> `launch_agent` -> `agent.run()` -> `_initialize_workers` ->
`_start_workers` -> `start_processes` -> `PContext.start` -> `SubprocessContext._start` ->
`SubprocessHandler._popen` are plain calls in that thread (torch 2.13), which lives as long as
the agent.

The setting is armed only after the worker has started, so an agent that died in between would
never send it: `die_with_parent` then exits at once, seeing a parent other than the one read at the
first line of the entry point (the orphan was reparented to init or a subreaper). Left open: an
agent that dies during the interpreter's start, before that first line (tens of milliseconds).
Reparenting to pid 1 alone is not taken as orphaning: torchrun itself is pid 1 when it is a
container's entry point (and when it dies there, the kernel kills the whole pid namespace).

Processes of the worker's own: DataLoader workers exit when the worker does (PyTorch's
`ManagerWatchdog` polls the parent pid, torch/utils/data/_utils/worker.py), and so do Inductor's
compile workers (their own parent-pid watchdog); PDEATHSIG is not inherited across fork. torch's
checkpoint process (`async_mode = "async_with_pinned_mem"`) imports train_cpt.py as `__mp_main__` and
does not arm it: it is spawned from a thread that exits after that save, which would kill it. It ends
when its pipe to the worker closes, and a save it is writing when the worker dies stops before its
`.metadata` (components/checkpoint/sealed_save.py), so it never completes a checkpoint a relaunch may be writing.

Stdlib only: `train_cpt.py` loads this file before torch, so that arming costs milliseconds.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

logger = logging.getLogger("mhar_titan.components.lifetime")

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PR_GET_PDEATHSIG = 2
AGENT_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun's agent in every worker's environment
ORPHAN_EXIT_CODE = 1


def started_by_torchelastic() -> bool:
    """Whether this process is a torchrun (torchelastic) worker."""
    return AGENT_ENV in os.environ


def parent_death_signal() -> int:
    """The signal this process gets when its parent dies (0: none; also 0 off Linux)."""
    if not sys.platform.startswith("linux"):
        return 0
    sig = ctypes.c_int(0)
    _prctl(PR_GET_PDEATHSIG, ctypes.addressof(sig))
    return sig.value


def die_with_parent(parent_at_start: int) -> bool:
    """Get SIGKILL when the parent dies; exit at once if it already has.

    `parent_at_start` is `os.getppid()` as read first thing in the process: a different parent now
    (init, pid 1, or a subreaper) means the parent died before the signal was armed, and it would
    never come. Returns whether the signal is armed (False off Linux, where this is a no-op).
    """
    if not sys.platform.startswith("linux"):
        logger.debug(f"die_with_parent: no parent-death signal on {sys.platform}; workers may outlive their agent")
        return False
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    parent = os.getppid()
    if parent != parent_at_start:
        print(
            f"{sys.argv[0]}: pid {os.getpid()}: its parent, pid {parent_at_start}, is gone (parent now pid {parent}); "
            "exiting before training, so as not to overlap with a requeued job",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(ORPHAN_EXIT_CODE)
    return True


def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)):
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}, {arg}): {os.strerror(err)}")


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc's parent links (torchrun starts each worker in a session of its own,
    so a process group does not find them)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        out.append(child)
        todo.extend(children.get(child, []))
    return out
