"""Stop at a step boundary with a checkpoint when the scheduler asks, and say so to the launcher.

A request is SIGTERM or SIGUSR1 reaching a worker, or a file `<dump_folder>/STOP` (what the
launchers write when they themselves are signalled: signals do not cross torchrun or srun
reliably). All ranks agree on it in the trainer's per-step all-reduce, then at the step boundary the
trainer checkpoints, rank 0 writes `<dump_folder>/preempted.json`, and the workers exit with
REQUEUE_EXIT_CODE; the launchers turn the marker into that exit code and SLURM requeues.
"""

from __future__ import annotations

import json
import os
import signal
import time

from torchtitan.tools.logging import logger

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL
STOP_FILE = "STOP"
MARKER_FILE = "preempted.json"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_IMPORTED = time.time()  # about when this worker started; a STOP file older than that is stale


class Preempted(SystemExit):
    """Raised after the preemption checkpoint; run() exits with REQUEUE_EXIT_CODE once torn down."""

    def __init__(self, step: int, reason: str):
        super().__init__(REQUEUE_EXIT_CODE)
        self.step, self.reason = step, reason


class PreemptionWatch:
    def __init__(self, dump_folder: str):
        self.dump_folder = dump_folder
        self.signal_name: str | None = None
        for sig in SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signal_name = signal.Signals(signum).name

    @property
    def stop_file(self) -> str:
        return os.path.join(self.dump_folder, STOP_FILE)

    def clear_stale_marker(self) -> None:
        """Rank 0, at start: a marker or STOP file left by an earlier job must not requeue or stop this one."""
        path = os.path.join(self.dump_folder, MARKER_FILE)
        if os.path.exists(path):
            os.remove(path)
        if os.path.exists(self.stop_file) and os.path.getmtime(self.stop_file) < _IMPORTED - 1:
            logger.warning(f"{self.stop_file}: left by an earlier job; removed")
            os.remove(self.stop_file)

    def local_request(self, check_file: bool = True) -> str | None:
        """Why this process should stop (a signal it got, or the STOP file), or None; the trainer
        makes every rank agree on it in its per-step all-reduce."""
        if self.signal_name:
            return self.signal_name
        return "stop file" if check_file and os.path.exists(self.stop_file) else None

    def mark(self, step: int, reason: str) -> None:
        """Rank 0, after the checkpoint: tell the launcher to requeue."""
        path = os.path.join(self.dump_folder, MARKER_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump({"step": step, "reason": reason, "time": time.time()}, f)
        os.replace(path + ".tmp", path)
        if os.path.exists(self.stop_file):
            os.remove(self.stop_file)
