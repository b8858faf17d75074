"""Loss and gradient-norm spikes: the robust score on constructed series, its state across a resume, the record and
the checkpoint kept before a spike, a spike forced into a real 2-rank job, and both arms side by side in the report.
(The scores of a resumed job equal the uninterrupted job's: tests/test_train_resume.py.)"""

import json
import statistics

import pytest
import torch.distributed.checkpoint as dcp
from conftest import REPO, torchrun
from torch.distributed.checkpoint.api import CheckpointException

from mhar_titan.compare.report import _spike_lines
from mhar_titan.components import spikes
from mhar_titan.components.checkpoint.manager import DataOnlyLoadPlanner
from mhar_titan.components.tensorboard_scalars import read_scalars
from mhar_titan.config import parse_config

# A flat series with a fixed wiggle (median 2.0, MAD 0.02), then one jump.
SERIES = [2.0 + 0.01 * ((s * 7) % 5 - 2) for s in range(1, 31)]


def test_a_jump_is_scored_against_the_median_and_mad_of_the_window_before_it():
    monitor = spikes.SpikeMonitor(window=20, min_history=10, threshold=6.0)
    found = []
    for step, x in enumerate(SERIES, 1):
        found += monitor.observe(step, {"loss": x, "grad_norm": 1.0 + x})
    assert found == [] and monitor.count == {"loss": 0, "grad_norm": 0}  # wiggles of 1 MAD: no spike
    past = SERIES[-20:]
    median = statistics.median(past)
    scale = spikes.MAD_TO_SD * statistics.median(abs(v - median) for v in past)
    (spike,) = monitor.observe(31, {"loss": 2.5, "grad_norm": float("nan")})  # a NaN step is not scored
    assert (spike.tag, spike.step, spike.median) == ("loss", 31, median)
    assert spike.score == (2.5 - median) / scale and spike.score > 6
    assert monitor.observe(32, {"loss": 1.5, "grad_norm": 3.0}) == []  # a drop is not a spike
    assert monitor.metrics()["spikes/loss_count"] == 1.0 and monitor.metrics()["spikes/loss_score"] < -6


def test_nothing_is_scored_before_min_history_and_the_state_resumes_exactly():
    first = spikes.SpikeMonitor(window=8, min_history=5, threshold=3.0)
    for step, x in enumerate(SERIES[:4], 1):
        assert first.observe(step, {"loss": 100.0 * x, "grad_norm": x}) == [] and first.scores == {}
    second = spikes.SpikeMonitor(window=8, min_history=5, threshold=3.0)
    second.load(first.state())
    for step, x in enumerate(SERIES[4:], 5):  # the same scores, bit for bit, from the restored windows
        values = {"loss": x, "grad_norm": x * (3 if step == 20 else 1)}
        assert first.observe(step, values) == second.observe(step, values)
        assert first.scores == second.scores
    assert first.state() == second.state() and second.count["grad_norm"] == 1


def test_the_record_is_cut_back_at_a_resume_and_names_the_checkpoint_kept(tmp_path):
    made = [spikes.Spike(s, "loss", 9.0, 2.0, 0.1, 70.0, s - 1) for s in (5, 9)]
    spikes.append(str(tmp_path), made[:1])
    spikes.append(str(tmp_path), made[1:])
    assert spikes.read(str(tmp_path)) == made
    assert spikes.cut_back(str(tmp_path), 8) == made[:1] and spikes.read(str(tmp_path)) == made[:1]
    assert spikes.newest_before([2, 4, 6, 8], 8) == 6 and spikes.newest_before([8], 8) is None
    # a spike seen at step 61 is in the weights step 60 updated: step 60's checkpoint holds it, 59's does not
    assert spikes.newest_before([58, 59, 60], 61) == 59 and spikes.newest_before([60], 61) is None
    line = made[0].line(6.0, 100)
    assert line.startswith("step 5: loss spike, 9 against a median of 2 over the last 100 steps (robust score 70.0")
    assert line.endswith("checkpoint step-4 kept out of retention")


def test_a_checkpoint_saved_before_spike_scoring_loads_with_fresh_windows(tmp_path):
    dcp.save({"train_state": {"step": 3}}, checkpoint_id=str(tmp_path / "old"), no_dist=True)
    state = {"train_state": {"step": 0, "spikes": "fresh"}}
    planner = DataOnlyLoadPlanner()
    dcp.load(state, checkpoint_id=str(tmp_path / "old"), planner=planner, no_dist=True)
    assert state == {"train_state": {"step": 3, "spikes": "fresh"}} and planner.absent == ["train_state.spikes"]
    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: train_state.tokens"):
        dcp.load(
            {"train_state": {"tokens": 0}},
            checkpoint_id=str(tmp_path / "old"),
            planner=DataOnlyLoadPlanner(),
            no_dist=True,
        )  # (any other entry is still required)


@pytest.mark.parametrize("bad", [("window", "3", "min_history", "4"), ("min_history", "2"), ("threshold", "0")])
def test_spike_settings_that_cannot_score_are_refused(bad):
    argv = ["--job.config_file", str(REPO / "configs" / "tiny_cpu.toml")]
    argv += [a if i % 2 else f"--spikes.{a}" for i, a in enumerate(bad)]
    with pytest.raises(ValueError, match=r"\[spikes\] window = .* need window >= min_history >= 3 and threshold > 0"):
        parse_config(argv)


def test_a_forced_spike_is_said_recorded_and_the_checkpoint_before_it_kept(tmp_path):
    run = tmp_path / "run"
    settings = ("--spikes.window", "6", "--spikes.min_history", "4", "--spikes.keep_checkpoint_before")
    keep = ("--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2", "--validation.no-enable")
    one = ("--training.global_batch_size", "8")  # one rank, two microbatches (2 ranks: test_train_resume.py)
    proc = torchrun(
        run,
        *("--training.steps", "10"),
        *settings,
        *keep,
        *one,
        nproc=1,
        script="tests/faulty_trainer.py",
        env={"SPIKE_STEPS": "8", "SPIKE_FACTOR": "30"},
    )
    log = proc.stdout + proc.stderr
    assert "step 8: loss spike, " in log and "checkpoint step-6 kept out of retention" in log
    recorded = spikes.read(str(run))
    assert {(s.tag, s.kept_checkpoint) for s in recorded if s.step == 8} == {("loss", 6), ("grad_norm", 6)}
    # none before; after it only the gradient norm, raised by the spike's update in Adam's moments
    later = [s for s in recorded if s.step != 8]
    assert later and all(s.step > 8 and s.tag == "grad_norm" for s in later), later
    assert all(s.kept_checkpoint == {9: 6, 10: 8}[s.step] for s in later), later  # from before step s - 1's update
    loss = read_scalars(run)
    assert [s.value for s in recorded if s.tag == "loss"] == [pytest.approx(loss[8], rel=1e-6)]
    assert read_scalars(run, "spikes/loss") == {8: pytest.approx(loss[8], rel=1e-6)}
    assert read_scalars(run, "spikes/loss_count") == {s: float(s >= 8) for s in range(1, 11)}
    assert list(read_scalars(run, "spikes/loss_score")) == [5, 6, 7, 8, 9, 10]  # from the 5th step on
    # retention kept the two newest and the one before the spike
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["step-10", "step-6", "step-8"]


def test_the_report_sets_both_arms_spikes_side_by_side(tmp_path):
    for arm in ("control", "mhar"):
        (tmp_path / arm).mkdir()
    spikes.append(
        str(tmp_path / "mhar"),
        [
            spikes.Spike(40, "loss", 3.1, 2.4, 0.02, 35.0),
            spikes.Spike(41, "loss", 2.9, 2.4, 0.02, 25.0),
            spikes.Spike(41, "grad_norm", 9.0, 0.5, 0.1, 85.0, 40),
        ],
    )
    arms = {arm: {"scored": True, **spikes.summary(str(tmp_path / arm))} for arm in ("control", "mhar")}
    text = "\n".join(_spike_lines(arms, "control", "mhar"))
    assert "| loss spikes | 0 | 2 (steps 40, 41); largest at step 40: 3.1 against a median of 2.4, score 35.0 |" in text
    assert (
        "| gradient-norm spikes | 0 | 1 (steps 41); largest at step 41: 9 against a median of 0.5, score 85.0 |" in text
    )
    arms["control"]["scored"] = False
    assert "| loss spikes | not scored | 2 (steps 40, 41)" in "\n".join(_spike_lines(arms, "control", "mhar"))
    assert json.loads(json.dumps(arms))  # plain data, as the comparison's JSON holds it
