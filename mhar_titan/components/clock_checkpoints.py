"""Temporary checkpoints by the clock (`[checkpoint] interval_minutes`), beside the step interval: a crash loses at
most that many minutes of work, not a whole interval (500 steps of the 8B configs are about two hours).

Rank 0's clock decides, and every rank takes its decision from the step's readback (a `max` over ranks of rank 0's
vote), so all save at the same step. The checkpoint is the manager's `save_temporary`: every guarantee of the
interval's checkpoints, and only the newest temporary one kept (components/checkpoint/layout.py, `retained`).
Saving computes nothing: a run with these checkpoints logs what one without them logs, bit for bit.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from mhar_titan.components.hooks import Hook, Request, SaveNow, Scalar, Step, on_device


class ClockCheckpoints(Hook):
    name = "clock_checkpoints"

    def __init__(self, minutes: float):
        if minutes <= 0:
            raise ValueError(f"[checkpoint] interval_minutes = {minutes}: a positive number of minutes (0: none)")
        self.seconds = minutes * 60.0

    def set_up(self, trainer: Any) -> None:
        self.rank0 = torch.distributed.get_rank() == 0
        self.interval = trainer.job_config.checkpoint.interval
        self.since = time.monotonic()
        self.due = False

    def start(self, step: int) -> None:
        self.since = time.monotonic()  # the job's load is its newest checkpoint

    def scalars(self, step: Step) -> dict[str, Scalar]:
        vote = self.rank0 and time.monotonic() - self.since >= self.seconds
        return {"clock_checkpoint": Scalar(on_device(vote, step.loss), "max")}

    def after_step(self, step: Step) -> None:
        self.due = bool(step.values["clock_checkpoint"])

    def after_save(self, step: Step) -> None:
        if step.last or step.number % self.interval == 0:  # the interval's checkpoint restarts the clock
            self.since = time.monotonic()

    def request(self, step: Step) -> Request | None:
        if not self.due or step.last or step.number % self.interval == 0:
            return None
        self.since = time.monotonic()
        return SaveNow(f"{self.seconds / 60:g} minutes since the last checkpoint", temporary=True)
