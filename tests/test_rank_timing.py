"""Each rank's time at every log step (components/rank_timing.py): a rank made slow is named in the log line and
TensorBoard at every log step and warned once as a straggler, with its host."""

import socket

import pytest
from conftest import torchrun

from mhar_titan.components.checkpoint.testing import slow_rank
from mhar_titan.components.rank_timing import MEASURES, RankTiming, rank_tag, slowest
from mhar_titan.components.tensorboard_scalars import read_scalars

SLEEP_S = 0.1  # before each block's forward on rank 1: +0.4 s a step, against about 0.2 s of compute a rank
STEPS = 5


def test_the_slowest_rank_is_the_one_with_the_most_data_and_compute_time():
    rows = [[1.0, 0.25, 0.5], [1.0, 0.0, 1.0], [1.0, 0.25, 0.25]]  # step, data, compute: sums exact in binary
    assert slowest(rows) == (1, 1.0, 0.75)
    assert rank_tag("compute_s", 7) == "ranks_compute_s/rank007"
    with pytest.raises(ValueError, match=r"^\[stragglers\] share = 0.0 must be > 0"):
        RankTiming(0.0, 3)
    with pytest.raises(ValueError, match=r"^\[stragglers\] windows = 0 must be >= 1"):
        RankTiming(0.1, 0)


def test_the_slow_rank_seam_reads_its_value(monkeypatch):
    monkeypatch.setenv("MHAR_TEST_SLOW_RANK", "1:0.5")
    assert slow_rank() == (1, 0.5)
    monkeypatch.setenv("MHAR_TEST_SLOW_RANK", "one")
    with pytest.raises(ValueError, match="<rank>:<seconds>"):
        slow_rank()


def test_a_slow_rank_is_named_at_every_log_step_and_warned_once_as_a_straggler(tmp_path):
    run = tmp_path / "run"
    args = ("--training.steps", str(STEPS), "--validation.no-enable", "--checkpoint.no-enable")
    proc = torchrun(run, *args, "--stragglers.windows", "2", env={"MHAR_TEST_SLOW_RANK": f"1:{SLEEP_S}"})
    log = proc.stdout + proc.stderr
    warned = [line for line in log.splitlines() if "is a straggler" in line]
    assert warned and all(f"rank 1 on host {socket.gethostname()} is a straggler" in line for line in warned)
    assert len(warned) <= 2  # once, on each rank that logs it
    assert all("for 2 log windows in a row" in line for line in warned) and "step 2: rank 1" in warned[0]
    assert log.count("slowest rank 1 (+") >= STEPS  # every log step's line (log_freq 1), on rank 0 at least
    assert read_scalars(run, "ranks/slowest") == dict.fromkeys(range(1, STEPS + 1), 1.0)
    assert read_scalars(run, "ranks/straggling") == dict.fromkeys(range(1, STEPS + 1), 1.0)
    slow, fast = read_scalars(run, rank_tag("compute_s", 1)), read_scalars(run, rank_tag("compute_s", 0))
    layers = 4  # configs/tiny_cpu.toml's model, one microbatch a step
    assert all(slow[s] >= layers * SLEEP_S and slow[s] > fast[s] for s in slow)  # its sleeps are in its time
    hours = read_scalars(run, "time/gpu_hours")  # components/compute_clock.py, in the same run
    assert sorted(hours) == list(range(1, STEPS + 1)) and all(hours[s] < hours[s + 1] for s in range(1, STEPS))
    for measure in MEASURES:
        assert set(read_scalars(run, rank_tag(measure, 0))) == set(range(1, STEPS + 1))
