"""The soak's parts that need no cluster (chaos/): the fault schedule a seed draws, the job log split into runs, the
verdict on made-up runs (each check must fail where it should), the comparison of logged values, and the seams'
lists of faults. The soak itself runs under a real Slurm in tests/test_slurm_real.py."""

import dataclasses

import pytest
from torch.utils.tensorboard import SummaryWriter

from chaos.joblog import JobRun, job_runs
from chaos.schedule import CLEAR, EXTERNAL, INJECTED, LAST_CLEAR, Fault, draw
from chaos.verdict import HANG_GRACE_S, ArmVerdict, Fired, compare_values, judge_arm
from mhar_titan.components.checkpoint import testing


@pytest.mark.parametrize("seed", range(20))
def test_a_seed_draws_one_schedule_every_kind_dealt_and_no_fault_near_an_injected_one(seed):
    faults = draw(seed, 40, 10, 3)
    assert faults == draw(seed, 40, 10, 3)
    injected = [f for f in faults if f.kind in INJECTED]
    assert sorted(f.kind for f in injected) == ["crash", "hang"] and all(f.arm is None for f in injected)
    outside = [f for f in faults if f.kind in EXTERNAL]
    assert len(outside) == 6 and set(EXTERNAL) <= {f.kind for f in outside}  # every kind once before any twice
    for f in faults:
        assert 2 <= f.step <= 40 - LAST_CLEAR, f
        if f.kind == "hang" and f.site in ("save", "validation"):  # where a checkpoint (and a validation) comes
            assert f.step % 10 == 0, f
    for f in outside:
        assert not any(f.step <= i.step <= f.step + CLEAR for i in injected), f
        assert 0 <= f.delay < 1 and f.rank in (0, 1)
    for arm in ("control", "mhar"):
        steps = [f.step for f in outside if f.arm == arm]
        assert len(steps) == len(set(steps)) == 3


def test_too_few_steps_for_the_faults_is_an_error_naming_them():
    with pytest.raises(ValueError, match="12 steps cannot hold a crash, a hang and 8 external faults an arm"):
        draw(0, 12, 4, 8)


def line(t: str, text: str) -> str:
    return f"[rank0]:[titan] 2026-12-07 10:00:{t} - root - INFO - {text}\n"


LOG = (
    "launch/slurm.sbatch: job 7 (restart 0) on vm; dump folder x\n"
    + line("00,000", "Training starts at step 1")
    + line("01,000", "step 1/8  loss 8.1")
    + line("02,000", "step 2/8  loss 8.0")
    + line("02,500", "/runs/a/checkpoint/step-2: written and checksummed in 0.2 s")
    + line("03,500", "step 3/8  loss 7.9")
    + "launch/slurm.sbatch: srun exited 1\n"
    + "launch/slurm.sbatch: job 7 (restart 1) on vm; dump folder x\n"
    + line("20,000", "Training starts at step 3")
    + line("21,000", "step 3/8  loss 7.9")
)


def test_a_job_log_splits_into_its_runs_with_the_trainers_time_stamps():
    first, second = job_runs(LOG)
    assert (first.job, first.restart, first.resumed, second.restart, second.resumed) == (7, 0, 0, 1, 2)
    assert [s for s, _ in first.steps] == [1, 2, 3] and [s for s, _ in first.saves] == [2]
    assert first.steps[1][1] - first.started == 2.0 and first.saves[0][1] - first.steps[1][1] == 0.5
    assert first.gaps() == [1.0, 1.0, 1.5] and first.last_step == 3 and first.last_progress == first.steps[2][1]
    assert "srun exited 1" in first.text and "srun exited 1" not in second.text


def run(restart: int, resumed: int, steps: list[tuple[int, float]], text: str = "") -> JobRun:
    return JobRun(7, restart, text, started=steps[0][1] - 1.0, resumed=resumed, steps=steps)


def ending(cls: str, t: float, step: int | None, cause: str = "") -> dict:
    return {"class": cls, "time": t, "step": step, "cause": cause}


CRASH = Fault("crash", 3)
KILL = Fault("kill", 2, "control", rank=1)


def judge(runs, endings, fired, injected=(CRASH,), max_restarts=2) -> ArmVerdict:
    began = {(7, r.restart): r.started - 2.0 for r in runs}
    clock = {"clock_s": 6.0, "watchdog": (10.0, 3.0), "max_restarts": max_restarts, "began": began}
    return judge_arm("control", runs, endings, fired, list(injected), **clock)


def fine_arm():
    """A kill after step 2 (checkpoint at 2, resumed there), then the crash after step 3, then the end."""
    runs = [
        run(0, 0, [(1, 100.0), (2, 101.0)], "restart 1 of 2"),
        run(1, 2, [(3, 140.0)], "restart 2 of 2"),
        run(2, 2, [(3, 170.0), (4, 171.0)]),
    ]
    endings = [
        ending("crashed", 105.0, None, "exit code 1"),
        ending("crashed", 145.0, 3, "RuntimeError: TEST CRASH (MHAR_TEST_CRASH) after step 3"),
        ending("finished", 172.0, 4),
    ]
    return runs, endings, [Fired(KILL, 101.5, 0, 2, 7)]


def test_an_arm_whose_runs_end_as_their_faults_say_passes_with_its_figures():
    v = judge(*fine_arm())
    assert v.problems == [] and v.restarts == 2
    kill, crash = v.outcomes
    assert (kill.kind, kill.ended, kill.lost_steps, kill.lost_s) == ("kill", "crashed", 0, 0.5)
    assert (crash.kind, crash.lost_steps, crash.lost_s) == ("crash", 1, 140.0 - 139.0)  # since its run began
    assert (kill.queued_s, kill.restart_s, kill.recover_s) == (137.0 - 101.5, 139.0 - 101.5, 140.0 - 101.5)
    assert kill.allowed_s == 6.0 + 2 * 1.0  # the clock's interval and the two longest gaps between step lines
    assert (kill.ended_s, kill.bound_s) == (105.0 - 101.5, 10.0 + HANG_GRACE_S)  # the watchdog's floor: steps of 1 s


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda r, e, f: e[0].update({"class": "hung"}), "ended hung (exit code 1) after control: SIGKILL rank 1"),
        (lambda r, e, f: e[1].update({"step": 4}), "ended crashed at step 4"),
        (lambda r, e, f: e.pop(), "3 job runs in the log but 2 endings"),
        (lambda r, e, f: e[2].update({"class": "crashed"}), "the last run ended crashed, not finished"),
        (lambda r, e, f: f.__setitem__(0, dataclasses.replace(f[0], at=109.5)), "8.5 s of work lost, over the 8.0 s"),
        (lambda r, e, f: e[0].update({"time": 101.5 + 10.0 + HANG_GRACE_S + 1}), "s after its last progress, over"),
        (lambda r, e, f: r[1].__setattr__("text", ""), "no 'restart 2 of 2' in the log"),
        (lambda r, e, f: r[0].__setattr__("text", "restart 1 of 2 death signal"), "torchrun's own signal handling"),
        (lambda r, e, f: f.append(Fired(KILL, 175.0, 2, 4, 7)), "hit the last job run, which finished anyway"),
    ],
)
def test_each_check_fails_where_it_should(change, problem):
    runs, endings, fired = fine_arm()
    change(runs, endings, fired)
    problems = judge(runs, endings, fired).problems
    assert any(problem in p for p in problems), problems


def test_a_preemption_that_loses_a_step_and_a_budget_overrun_are_named():
    runs, endings, fired = fine_arm()
    warning = Fault("warning", 2, "control")
    endings[0].update({"class": "preempted", "step": 2})
    runs[0].steps.append((3, 101.8))  # logged step 3, resumed from 2
    runs[0].text += "got SIGUSR1; asking the trainer to checkpoint and stop; the trainer checkpointed and stopped"
    problems = judge(runs, endings, [dataclasses.replace(fired[0], fault=warning)], max_restarts=0).problems
    assert any("preempted at step 3, resumed from step 2: work lost" in p for p in problems), problems
    assert any("1 restarts, over the budget of 0" in p for p in problems), problems


def write(folder, values: dict[int, float]) -> None:
    with SummaryWriter(str(folder)) as w:
        for step, value in values.items():
            w.add_scalar("train/loss", value, step)
            w.add_scalar("time/step_s", 0.1 * step, step)  # measured: never compared


def test_every_logged_value_is_compared_also_the_ones_a_later_run_computed_again(tmp_path):
    write(tmp_path / "ref", {1: 8.0, 2: 7.5, 3: 7.0})
    write(tmp_path / "arm" / "a", {1: 8.0, 2: 7.5})
    write(tmp_path / "arm" / "b", {2: 7.5, 3: 7.0})
    v = ArmVerdict()
    compare_values("control", tmp_path / "arm", tmp_path / "ref", v)
    assert v.problems == [] and v.values == 4
    write(tmp_path / "arm" / "c", {2: 7.25})  # a run that computed step 2 again, differently
    compare_values("control", tmp_path / "arm", tmp_path / "ref", v)
    assert v.problems == ["control: train/loss at step 2 is 7.25, the uninterrupted arm's 7.5"]


def test_the_seams_take_a_list_of_steps_and_refuse_two_at_one_step(monkeypatch):
    monkeypatch.setenv(testing.CRASH_ENV, "9:always, 5:once")
    monkeypatch.setenv(testing.HANG_ENV, "7:loader:once,3:save")
    assert testing.crashes() == [(5, False), (9, True)]
    assert testing.hangs() == [(3, "save", False), (7, "loader", True)]
    monkeypatch.setenv(testing.CRASH_ENV, "5:once,5:always")
    with pytest.raises(ValueError, match="at most one entry a step"):
        testing.crashes()
    monkeypatch.setenv(testing.HANG_ENV, "7:desk")
    with pytest.raises(ValueError, match="the site one of collective, loader, save"):
        testing.hangs()
