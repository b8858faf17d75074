"""How a job ended and whether its launcher starts it again (components/endings.py): classes by exit code, the
crash and hang records a launch left, the restart budget over its window with a doubling wait, the same failure at
the same step twice in a row not restarted, the rest never."""

import json
import os

import pytest

from mhar_titan import restarts
from mhar_titan.components import endings
from mhar_titan.components.exit_codes import HUNG


def test_each_exit_code_has_its_class():
    classes = {code: endings.classify(code) for code in (0, 1, 2, 3, 66, 73, 75, 124, 125, 137, -9)}
    assert classes == {
        0: "finished",
        1: "crashed",
        2: "refused",
        3: "stopped",  # a hook's own code
        66: "data_exhausted",
        73: "lock_lost",
        75: "preempted",
        124: "hung",
        125: "stopped",
        137: "crashed",  # killed by SIGKILL, as a shell reads it
        -9: "crashed",
    }


def crash_record(run, step, rank, cause, when):
    (run / "crashes").mkdir(parents=True, exist_ok=True)
    record = {"time": when, "host": "h", "rank": rank, "pid": 1, "step": step, "cause": cause}
    path = run / "crashes" / f"step-{step}-rank-{rank}.json"
    path.write_text(json.dumps(record))
    os.utime(path, (when, when))  # written at `when`: before or after the launch it is judged for
    return path


def decide(run, code, now, launched=0.0):
    return endings.decide(str(run), code, launched, max_restarts=3, window_s=3600, backoff_s=30, now=now)


def test_restarts_within_the_budget_with_a_doubling_wait_then_none(tmp_path):
    run = tmp_path / "run"
    lines = []
    for i, now in enumerate((1000.0, 1100.0, 1200.0, 1300.0)):
        crash_record(run, 10 + i, 1, f"RuntimeError: NCCL error {i}", now - 1)
        lines.append(decide(run, 1, now, launched=now - 50))
    assert [(d.restart, d.delay_s, d.exhausted) for d in lines] == [
        (True, 30, False),
        (True, 60, False),
        (True, 120, False),
        (False, 0, True),
    ]
    assert lines[0].line == "crashed (exit 1) at step 10, rank 1: RuntimeError: NCCL error 0: restart 1 of 3 in 30 s"
    assert lines[3].line.endswith("not restarted, 3 restarts within 60 minutes already ([job] max_restarts = 3)")
    # an hour after the first, the window holds two: a restart again
    crash_record(run, 20, 0, "RuntimeError: late", 4700)
    assert decide(run, 1, 4701.0, launched=4650).restart
    recorded = endings.read_endings(str(run))
    assert [(e["class"], e["step"], e["rank"]) for e in recorded] == [
        ("crashed", 10, 1),
        ("crashed", 11, 1),
        ("crashed", 12, 1),
        ("crashed", 13, 1),
        ("crashed", 20, 0),
    ]


def test_the_same_failure_at_the_same_step_twice_in_a_row_is_not_restarted(tmp_path):
    run = tmp_path / "run"
    crash_record(run, 7, 1, "RuntimeError: boom", 99)
    assert decide(run, 1, 100.0, launched=50).restart
    crash_record(run, 7, 1, "RuntimeError: boom", 199)
    again = decide(run, 1, 200.0, launched=150)
    assert not again.restart and again.exhausted
    assert again.line == "crashed (exit 1) at step 7, rank 1: RuntimeError: boom, twice in a row: not restarted"


def test_a_hang_is_read_from_the_watchdogs_stacks_and_old_records_do_not_count(tmp_path):
    run = tmp_path / "run"
    (run / "hangs").mkdir(parents=True)
    for rank in (0, 1):
        (run / "hangs" / f"step-3-rank-{rank}.txt").write_text(
            f"2026-12-07T16:57:36+0000 hung: no progress for 3 s (timeout 3 s) on rank {rank}, host vm, pid 1, "
            "after after_step of step 3\n\nThread ...\n"
        )
    decision = decide(run, HUNG, 10**10, launched=0)
    assert decision.line == "hung (exit 124) at step 3, rank 0: hung after after_step of step 3: restart 1 of 3 in 30 s"
    # a crash record older than this launch is another job's: the ending says only the code
    crash_record(run, 1, 0, "RuntimeError: old", 5)
    later = decide(run, 1, 10**10 + 10, launched=10**10)
    assert later.line == "crashed (exit 1): restart 2 of 3 in 60 s"


@pytest.mark.parametrize("code", [0, 2, 66, 73, 75, 3])
def test_other_endings_are_recorded_and_never_restarted(tmp_path, code):
    decision = decide(tmp_path / "run", code, 100.0)
    assert not decision.restart and not decision.exhausted
    assert decision.line == f"{endings.classify(code)} (exit {code}): not restarted"
    endings.record_ending(str(tmp_path / "run"), 75, 12, "Preempted")
    assert [e["class"] for e in endings.read_endings(str(tmp_path / "run"))] == [endings.classify(code), "preempted"]


def test_the_launchers_question_refuses_a_bad_budget_or_config_in_one_line(tmp_path, capsys):
    run = str(tmp_path / "run")
    bad = ["1", "0", "configs/tiny_cpu.toml", "--job.dump_folder", run, "--job.max_restarts", "-1"]
    assert restarts.main(bad) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "python -m mhar_titan.restarts: [job] max_restarts = -1, restart_window_minutes = 60.0, restart_backoff_s "
        "= 30.0: need max_restarts >= 0 (0: never), a window > 0 and a backoff >= 0"
    ]
    assert restarts.main(["1", "0", str(tmp_path / "nope.toml")]) == 2
    assert "No such file or directory" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing recorded for a refused question
