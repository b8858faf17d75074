"""Stop at a step boundary with a checkpoint when the scheduler asks, and say so to the launcher.

A request is SIGTERM or SIGUSR1 reaching a worker, or a file `<dump_folder>/STOP` (what the
launchers write when they themselves are signalled: signals do not cross torchrun or srun
reliably). All ranks agree on it in the trainer's per-step all-reduce, then at the step boundary the
trainer checkpoints, rank 0 writes `<dump_folder>/preempted.json`, and the workers exit with
REQUEUE_EXIT_CODE; the launchers turn the marker into that exit code and SLURM requeues.

A launcher writes its launch id (MHAR_LAUNCH_ID, which the workers inherit) into STOP, so a STOP is
told apart by who wrote it, not by its age: this launch's STOP is a request even when it arrives
before the trainer started (a signal in the first seconds), another launch's is stale (a job killed
before its trainer saw it) and is removed at start or ignored later. An empty STOP (`touch STOP` by
hand) counts when it is newer than this worker.
"""

from __future__ import annotations

import json
import os
import signal
import time

from torchtitan.tools.logging import logger

from data.atomic import write_text
from mhar_titan.components.exit_codes import DATA_EXHAUSTED as DATA_EXHAUSTED_EXIT_CODE
from mhar_titan.components.exit_codes import REQUEUE as REQUEUE_EXIT_CODE

STOP_FILE = "STOP"
MARKER_FILE = "preempted.json"
LAUNCH_ID_ENV = "MHAR_LAUNCH_ID"  # set by launch/torchrun.sh (and passed on by slurm.sbatch)
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_IMPORTED = time.time()  # about when this worker started; an empty STOP file older than that is stale


class Preempted(SystemExit):
    """Raised after the preemption checkpoint; run() exits with REQUEUE_EXIT_CODE once torn down."""

    def __init__(self, step: int, reason: str):
        super().__init__(REQUEUE_EXIT_CODE)
        self.step, self.reason = step, reason


class SourcesExhausted(SystemExit):
    """`[data] on_source_exhausted = "stop"` and a source was read to its end: the run stops short of
    training.steps, with a checkpoint, and exits with DATA_EXHAUSTED_EXIT_CODE, never 0 ("completed")."""

    def __init__(self, step: int, total: int, sources: list[str], again: bool):
        super().__init__(DATA_EXHAUSTED_EXIT_CODE)
        names = ", ".join(sources)
        when = f"stopped at step {step} of {total}" if again else f"stops at step {step} of {total}, with a checkpoint"
        self.message = (
            f"mixture source(s) {names} read to their end with [data] on_source_exhausted = 'stop': the run {when}"
            + (", before training any step" if again else "")
            + f" (exit {DATA_EXHAUSTED_EXIT_CODE}). To go on: add shards to the source (allow_changes data) or "
            "set on_source_exhausted = 'repeat' (allow_changes data); or export this checkpoint as the result"
        )


class PreemptionWatch:
    def __init__(self, dump_folder: str, launch_id: str | None = None):
        self.dump_folder = dump_folder
        self.launch_id = os.environ.get(LAUNCH_ID_ENV, "") if launch_id is None else launch_id
        self.signal_name: str | None = None
        self._ignored: str | None = None
        for sig in SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signal_name = signal.Signals(signum).name

    @property
    def stop_file(self) -> str:
        return os.path.join(self.dump_folder, STOP_FILE)

    def _stop_writer(self) -> str | None:
        """The launch id written in STOP ("" for an empty one), None when there is no STOP."""
        try:
            with open(self.stop_file) as f:
                text = f.read().strip()
        except FileNotFoundError:
            return None
        return text.splitlines()[0].strip() if text else ""

    def _is_ours(self, writer: str) -> bool:
        if writer:
            return writer == self.launch_id
        return os.path.getmtime(self.stop_file) >= _IMPORTED - 1

    def clear_stale_marker(self) -> None:
        """Rank 0, at start (holding the run lock): a marker or STOP file left by an earlier job must not
        requeue or stop this one; this launch's own STOP, written before the trainer started, stays."""
        path = os.path.join(self.dump_folder, MARKER_FILE)
        if os.path.exists(path):
            os.remove(path)
        writer = self._stop_writer()
        if writer is None:
            return
        if self._is_ours(writer):
            logger.warning(f"{self.stop_file}: a stop was asked before training started; stopping after the first step")
            return
        by = f"launch {writer}" if writer else "hand (older than this job)"
        logger.warning(f"{self.stop_file}: left by an earlier job ({by}; this is launch {self.launch_id!r}); removed")
        os.remove(self.stop_file)

    def local_request(self, check_file: bool = True) -> str | None:
        """Why this process should stop (a signal it got, or this launch's STOP file), or None; the trainer
        makes every rank agree on it in its per-step all-reduce."""
        if self.signal_name:
            return self.signal_name
        writer = self._stop_writer() if check_file else None
        if writer is None:
            return None
        if writer == "" or writer == self.launch_id:
            return "stop file"
        if self._ignored != writer:
            self._ignored = writer
            logger.warning(
                f"{self.stop_file}: written by launch {writer}, not this job's ({self.launch_id!r}); ignored"
            )
        return None

    def mark(self, step: int, reason: str) -> None:
        """Rank 0, after the checkpoint: tell the launcher to requeue."""
        path = os.path.join(self.dump_folder, MARKER_FILE)
        write_text(path, json.dumps({"step": step, "reason": reason, "time": time.time()}))
        if os.path.exists(self.stop_file):
            os.remove(self.stop_file)
