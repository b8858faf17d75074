"""The run's training compute in GPU-hours (components/compute_clock.py): counted per step times the ranks, only
the steps, and carried through a checkpoint."""

import time

import torch.distributed.checkpoint as dcp

from mhar_titan.components.checkpoint.manager import DataOnlyLoadPlanner
from mhar_titan.components.compute_clock import STATE, TAG, ComputeClock
from mhar_titan.components.hooks import Step


def test_steps_count_their_time_times_the_ranks_and_a_checkpoint_carries_the_count():
    clock = ComputeClock()
    clock.world = 4
    for number in (1, 2):
        step = Step(number, last=False, log=number == 2)
        clock.before_step(step)
        time.sleep(0.05)
        clock.after_step(step)
        time.sleep(0.5)  # validation, a checkpoint, logging: not counted
    # 2 steps x 0.05 s x 4 ranks; were the 0.5 s between them counted, 4.4 s (the bound leaves a busy machine's
    # oversleeping room)
    assert 2 * 0.05 * 4 <= clock.gpu_seconds < 2.0
    assert clock.metrics(Step(1, last=False, log=False)) == {}
    assert clock.metrics(Step(2, last=False, log=True)) == {TAG: clock.gpu_seconds / 3600}
    resumed = ComputeClock()
    resumed.load_state_dict(clock.state_dict())
    assert resumed.gpu_seconds == clock.gpu_seconds
    resumed.load_state_dict({"step": 2})  # a checkpoint from before the count: it starts here
    assert resumed.gpu_seconds == clock.gpu_seconds and STATE in clock.state_dict()


def test_a_checkpoint_saved_before_the_count_loads_and_the_count_starts_there(tmp_path):
    dcp.save({"train_state": {"step": 3}}, checkpoint_id=str(tmp_path / "old"), no_dist=True)
    state = {"train_state": {"step": 0, STATE: 0.0}}
    planner = DataOnlyLoadPlanner()
    dcp.load(state, checkpoint_id=str(tmp_path / "old"), planner=planner, no_dist=True)
    assert state == {"train_state": {"step": 3, STATE: 0.0}} and planner.absent == [f"train_state.{STATE}"]
