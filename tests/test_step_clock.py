"""The log line's pace and ETA (mhar_titan/components/step_metrics.py, StepClock) on a fake clock."""

import mhar_titan.components.step_metrics as step_metrics
from mhar_titan.components.step_metrics import StepClock


def test_the_eta_counts_the_periodic_work_still_to_come(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(step_metrics.time, "perf_counter", lambda: now[0])
    clock = StepClock()
    clock.start(0, 100)
    clock.tick(1)  # the first step (compile) is left out
    assert clock.eta() == "?" and clock.pace(4096) == "? s/step  tokens 4,096 (1.0%)"
    for step in range(2, 11):
        now[0] += 2.0  # 2 s a step
        clock.tick(step)
    now[0] += 30.0
    clock.pause(30.0, "validation", 10)  # validation at step 10 took 30 s; it runs every 10 steps
    now[0] += 6.0
    clock.pause(6.0, "checkpoint", 50)  # a checkpoint took 6 s; every 50 steps
    assert clock.seconds_per_step() == 2.0
    # 90 steps x 2 s + 9 validations (20, ..., 100) x 30 s + 2 checkpoints (50, 100) x 6 s
    assert clock.eta_seconds() == 90 * 2.0 + 9 * 30.0 + 2 * 6.0
    assert clock.eta() == "7m42s"
    assert clock.pace(40960) == "2.00 s/step  tokens 40,960 (10.0%)"
