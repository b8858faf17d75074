"""A job that stops making progress ends as hung, with every rank's stacks, instead of holding its allocation.

A collective waiting on a rank that is stuck, a file system that never answers, a loader that never returns: none
of them raises. A thread on every rank notes each phase of the loop (the hooks' calls) and, when none comes within
the timeout, writes this rank's Python stacks (and NCCL's flight recorder where there is one) to
`<dump_folder>/hangs/step-<N>-rank-<r>.txt`, says so in the log and ends the process with HUNG (124). Every rank is
stuck alike (those waiting in a collective for the stuck one too), so every rank writes its stacks; torchrun passes
the code on and the launchers restart the job from its last checkpoint.

The timeout: `first_step_s` until the first step is done (compilation), then the longest of `floor_s` and `factor`
times the median time between the recent steps. The collectives' own timeout is raised above the floor, so that a
hung collective is seen here, with stacks, before it aborts the job as a crash.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torchtitan.tools.logging import logger

from mhar_titan.components.exit_codes import HUNG
from mhar_titan.components.hooks import Hook, Step

FOLDER = "hangs"
WINDOW = 20  # steps whose median time sizes the timeout
COLLECTIVE_MARGIN_S = 60.0  # the collectives' timeout exceeds the floor by this much


def timeout_s(floor_s: float, factor: float, first_step_s: float, step_times: list[float]) -> float:
    """first_step_s before any step time is known, else the longest of floor_s and factor x the median step time."""
    if not step_times:
        return first_step_s
    return max(floor_s, factor * statistics.median(step_times))


class Watchdog(Hook):
    name = "watchdog"

    def __init__(self, floor_s: float, factor: float, first_step_s: float):
        self.floor_s, self.factor, self.first_step_s = floor_s, factor, first_step_s
        self.step_times: deque[float] = deque(maxlen=WINDOW)
        self.last = time.monotonic()  # the last phase seen
        self.phase, self.step = "set-up", 0
        self._last_step_end: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.on_hang: list[Callable[[str], None]] = []  # told the cause before the exit (an alert)

    def set_up(self, trainer: Any) -> None:
        self.folder = os.path.join(trainer.job_config.job.dump_folder, FOLDER)
        self.rank = torch.distributed.get_rank()
        trainer.collective_timeout_s = max(trainer.collective_timeout_s, self.floor_s + COLLECTIVE_MARGIN_S)

    def _seen(self, phase: str, step: int) -> None:
        self.last, self.phase, self.step = time.monotonic(), phase, step

    def start(self, step: int) -> None:
        self._seen("start", step)
        self._thread = threading.Thread(target=self._watch, name="mhar-watchdog", daemon=True)
        self._thread.start()

    def before_step(self, step: Step) -> None:
        self._seen("before_step", step.number)

    def after_data(self, step: Step) -> None:
        self._seen("after_data", step.number)

    def after_backward(self, step: Step) -> None:
        self._seen("after_backward", step.number)

    def after_step(self, step: Step) -> None:
        now = time.monotonic()
        if self._last_step_end is not None:
            self.step_times.append(now - self._last_step_end)
        self._last_step_end = now
        self._seen("after_step", step.number)

    def after_save(self, step: Step) -> None:
        self._seen("after_save", step.number)

    def close(self) -> None:
        self._stop.set()

    def timeout(self) -> float:
        return timeout_s(self.floor_s, self.factor, self.first_step_s, list(self.step_times))

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.floor_s / 10)):
            silent, limit = time.monotonic() - self.last, self.timeout()
            if silent > limit:
                self._hung(silent, limit)

    def _hung(self, silent: float, limit: float) -> None:
        """This rank's stacks (and NCCL's record of its collectives) to the run folder, a log line, exit HUNG."""
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"step-{self.step}-rank-{self.rank}.txt")
        cause = (
            f"no progress for {silent:.0f} s (timeout {limit:.0f} s) on rank {self.rank}, host {socket.gethostname()}, "
            f"pid {os.getpid()}, after {self.phase} of step {self.step}"
        )
        with open(path, "w") as f:
            f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} hung: {cause}\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        _flight_recorder(path[: -len(".txt")] + ".nccl.json")
        logger.error(f"hung: {cause}; every thread's stack in {path}; exiting {HUNG}")
        for tell in self.on_hang:
            tell(f"{cause}; stacks in {path}")
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(HUNG)


def _flight_recorder(path: str) -> None:
    """NCCL's flight recorder of this rank's collectives, where the job runs NCCL with one
    (TORCH_NCCL_TRACE_BUFFER_SIZE > 0); nothing otherwise."""
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace_json", None)
    if dump is None or not torch.distributed.is_initialized() or torch.distributed.get_backend() != "nccl":
        return
    try:
        text = dump(includeCollectives=True, onlyActive=True)
    except Exception as e:  # a recorder that is off or failing must not keep the job from ending
        logger.warning(f"NCCL's flight recorder: {e}")
        return
    with open(path, "w") as f:
        f.write(text if isinstance(text, str) else text.decode())
