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
from typing import Any

import torch
from torchtitan.tools.logging import logger

from data.atomic import write_text
from mhar_titan.components.exit_codes import REQUEUE as REQUEUE_EXIT_CODE
from mhar_titan.components.hooks import Hook, Request, Scalar, Step, Stop, on_device
from mhar_titan.components.signals import CLUSTER_SIGNALS

STOP_FILE = "STOP"
MARKER_FILE = "preempted.json"
LAUNCH_ID_ENV = "MHAR_LAUNCH_ID"  # set by launch/torchrun.sh (and passed on by slurm.sbatch)
_IMPORTED = time.time()  # about when this worker started; an empty STOP file older than that is stale


class Preempted(SystemExit):
    """Raised after the preemption checkpoint; run() exits with REQUEUE_EXIT_CODE once torn down."""

    def __init__(self, step: int, reason: str):
        super().__init__(REQUEUE_EXIT_CODE)
        self.step, self.reason = step, reason


class PreemptionWatch:
    def __init__(self, dump_folder: str, launch_id: str | None = None):
        self.dump_folder = dump_folder
        self.launch_id = os.environ.get(LAUNCH_ID_ENV, "") if launch_id is None else launch_id
        self.signal_name: str | None = None
        self._ignored: str | None = None
        for sig in CLUSTER_SIGNALS:
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


class Preemption(Hook):
    """The watch in a job: every rank's request agreed each step (rank 0 alone reads the STOP file), and a stop
    short of the last step with a checkpoint, the marker and REQUEUE_EXIT_CODE."""

    name = "preemption"

    def set_up(self, trainer: Any) -> None:
        cfg = trainer.job_config
        self.rank0 = torch.distributed.get_rank() == 0
        self.checkpointing = cfg.checkpoint.enable
        self.watch = PreemptionWatch(cfg.job.dump_folder)
        self.asked: str | None = None
        self.reason: str | None = None
        if self.rank0:
            self.watch.clear_stale_marker()

    def scalars(self, step: Step) -> dict[str, Scalar]:
        self.asked = self.watch.local_request(check_file=self.rank0)
        return {"stop": Scalar(on_device(self.asked is not None, step.loss), "max")}

    def after_step(self, step: Step) -> None:
        self.reason = (self.asked or "another rank was asked to stop") if step.values["stop"] else None

    def request(self, step: Step) -> Request | None:
        return None if self.reason is None or step.last else self.stop(step.number, self.reason)

    def stop(self, step: int, reason: str) -> Stop:
        """A checkpoint, the marker (rank 0), exit REQUEUE_EXIT_CODE; with checkpointing off a plain failure: a
        requeued job would start over from the base."""
        if not self.checkpointing:
            error = RuntimeError(
                f"step {step}: asked to stop ({reason}); checkpointing is off, so nothing was saved and "
                "the job is not requeued (it would start over from step 0)"
            )
            return Stop(reason, error, checkpoint=False)

        def requeue() -> None:
            if self.rank0:
                self.watch.mark(step, reason)
            logger.warning(
                f"step {step}: preempted ({reason}); checkpoint written; exiting {REQUEUE_EXIT_CODE} to be requeued"
            )

        return Stop(reason, Preempted(step, reason), after_checkpoint=requeue)
