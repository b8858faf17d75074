"""The run's training compute so far, in GPU-hours: what the pair's report compares the arms at besides equal steps
and tokens (MHAR costs more time a step, so equal steps are not equal compute).

Each step counts the host's time from its start to its update (data, forward and backward, the read-back, the
update issued; the read-back waits for the device each step, so this follows the device's time) times the ranks.
Validation, checkpoints and logging are not counted. The count is checkpointed: a resumed run goes on from the
checkpoint's count, and a lost stretch of steps redone after a crash is counted once. `time/gpu_hours` at every log
step.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from mhar_titan.components.hooks import Hook, Step

STATE = "compute_gpu_seconds"
TAG = "time/gpu_hours"


class ComputeClock(Hook):
    """GPU-seconds of training steps, checkpointed, in TensorBoard as GPU-hours at log steps."""

    name = "compute_clock"

    def __init__(self) -> None:
        self.gpu_seconds = 0.0
        self.began = 0.0

    def set_up(self, trainer: Any) -> None:
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def before_step(self, step: Step) -> None:
        self.began = time.perf_counter()

    def after_step(self, step: Step) -> None:
        self.gpu_seconds += (time.perf_counter() - self.began) * self.world

    def metrics(self, step: Step) -> dict[str, float]:
        return {TAG: self.gpu_seconds / 3600} if step.log else {}

    def state_dict(self) -> dict[str, Any]:
        return {STATE: self.gpu_seconds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if STATE in state:  # a checkpoint from before the count (OPTIONAL_ENTRIES): counted from this start
            self.gpu_seconds = float(state[STATE])
