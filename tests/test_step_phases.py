"""Where a log window's time went: the shares from the phase boundaries on a fake clock (CPU) and on fake CUDA
events whose optimizer has not finished when the window closes (GPU: counted in the next window, no sync)."""

import pytest
import torch

from mhar_titan.components import step_phases
from mhar_titan.components.step_metrics import StepClock
from mhar_titan.components.step_phases import StepPhases, shares_text


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_shares_of_a_window_on_a_cpu(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(step_phases.time, "perf_counter", clock)
    phases = StepPhases(torch.device("cpu"))
    for at, boundary in ((0.0, "fetch"), (1.0, "data"), (1.5, "forward"), (4.0, "backward"), (5.0, "optimizer")):
        clock.now = at
        phases.mark(boundary)
    clock.now = 10.0
    out = phases.take({"checkpoint": 2.0, "validation": 1.0})
    want = {"data": 0.1, "forward_backward": 0.3, "optimizer": 0.1, "checkpoint": 0.2, "validation": 0.1}
    assert {k: out[f"time/{k}"] for k in want} == want  # each a sum of exact binary differences over 10
    assert out["time/other"] == pytest.approx(0.2, abs=1e-15) and not [k for k in out if k.startswith("memory")]
    assert shares_text(out) == "time data 10% fwd+bwd 30% opt 10% ckpt 20% val 10% other 20%"
    clock.now = 12.0
    assert phases.take({})["time/other"] == 1.0  # a new window: nothing marked in it


def test_the_step_clock_hands_each_windows_pauses_once():
    clock = StepClock()
    clock.pause(3.0, "checkpoint", 50)
    clock.pause(1.0, "validation", 25)
    clock.pause(2.0, "validation", 25)
    assert clock.take_pauses() == {"checkpoint": 3.0, "validation": 3.0} and clock.take_pauses() == {}


class FakeEvent:
    """A CUDA event at a fixed device time (ms), finished or not."""

    made: list["FakeEvent"] = []

    def __init__(self, enable_timing=False):
        self.ms, self.finished = None, True
        FakeEvent.made.append(self)

    def record(self):
        self.ms = len(FakeEvent.made) * 10.0  # the n-th event at n x 10 ms

    def query(self):
        return self.finished

    def elapsed_time(self, later):
        return later.ms - self.ms


def test_on_a_gpu_a_step_still_running_counts_in_the_next_window(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(step_phases.time, "perf_counter", clock)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 2**30)
    FakeEvent.made = []
    phases = StepPhases(torch.device("cpu"))
    phases.cuda = True
    for boundary in ("fetch", "data", "forward", "backward", "optimizer"):  # events at 10, 20, 30 ms
        phases.mark(boundary)
    FakeEvent.made[-1].finished = False  # the optimizer still runs on the device
    clock.now = 1.0
    first = phases.take({})
    assert first["time/forward_backward"] == 0.0 and first["memory/after_backward_gib"] == 1.0
    FakeEvent.made[-1].finished = True
    clock.now = 2.0
    second = phases.take({})  # this window: 10 ms forward/backward and 10 ms optimizer of the step before
    assert second["time/forward_backward"] == pytest.approx(0.01) and second["time/optimizer"] == pytest.approx(0.01)
    assert phases.pending == []
