"""What a soak round must show, arm by arm: every fault delivered and each job run ended as its fault says, every
crash and hang restarted within the budget, no more work lost than the clock's checkpoints allow, no run hung past
its timeout, and every value the arm logged, in every job run, equal to the uninterrupted arm's bit for bit.

Each check that fails is a line naming the arm, the job run and the value; the figures (work lost, time to recover)
come with it for the summary.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from chaos.joblog import JobRun
from chaos.schedule import ENDS_AS, EXTERNAL, RESTARTED, Fault
from mhar_titan.components.tensorboard_scalars import event_files, load_scalars

# Tags that measure the machine and the clock, not the computation: the rest must repeat bit for bit.
MEASURED = ("time/", "memory/", "job/", "tokens_per_s", "mfu", "ranks")  # ranks/, ranks_<measure>/: per-rank times
# After a run's last progress, what may pass before its end on top of the watchdog's timeout: the watchdog's poll
# (1 s), its stacks, torchrun stopping the other ranks (its own grace is 30 s) and the launcher's decision.
HANG_GRACE_S = 35.0
NEVER = ("death signal", "SignalException")  # torchrun's own handling of a cluster's SIGTERM (components/signals.py)
SAID = {  # what a job run that a fault ended must say, in its own log
    "warning": ("got SIGUSR1; asking the trainer to checkpoint and stop", "the trainer checkpointed and stopped"),
    "term": ("got SIGTERM; passed to the", "checkpointed after SIGTERM (scancel or preemption): not requeueing"),
    "requeue": ("got SIGTERM; passed to the", "checkpointed after SIGTERM"),
}
TIMEOUT = re.compile(r"hung: no progress for \d+ s \(timeout (\d+) s\)")


@dataclasses.dataclass(frozen=True)
class Fired:
    """An external fault as it was done."""

    fault: Fault
    at: float  # Unix time
    run: int  # the job run it hit (0-based)
    step: int  # the last step that run had logged
    job: int  # the Slurm job


@dataclasses.dataclass
class Outcome:
    """One fault's figures."""

    arm: str
    fault: str
    kind: str
    ended: str
    lost_steps: int
    lost_s: float
    allowed_s: float
    queued_s: float | None  # the fault to the next job run's start on the node (a requeue's wait, the other arm's run)
    ended_s: float  # the job run's end after its last progress (or the fault)
    bound_s: float  # what the watchdog allows for that: its timeout and HANG_GRACE_S
    restart_s: float | None  # the fault to training again
    recover_s: float | None  # the fault to a step beyond the last one it had logged


@dataclasses.dataclass
class ArmVerdict:
    problems: list[str] = dataclasses.field(default_factory=list)
    outcomes: list[Outcome] = dataclasses.field(default_factory=list)
    restarts: int = 0
    values: int = 0  # values compared


def computed(tag: str) -> bool:
    return not tag.startswith(MEASURED)


def every_value(run_dir: Path) -> list[tuple[str, int, float]]:
    """Every (tag, step, value) the run logged, in every event file: also the steps a later job run computed again."""
    found = []
    for path in event_files(run_dir):
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in filter(computed, acc.Tags()["scalars"]):
            found += [(tag, e.step, e.value) for e in acc.Scalars(tag)]
    return found


def compare_values(arm: str, run_dir: Path, reference_dir: Path, verdict: ArmVerdict) -> None:
    reference = {tag: series for tag, series in load_scalars(reference_dir).items() if computed(tag)}
    logged = every_value(run_dir)
    seen = {(tag, step) for tag, step, _ in logged}
    for tag, step, value in logged:
        want = reference.get(tag, {}).get(step)
        if want is None:
            verdict.problems.append(f"{arm}: {tag} at step {step} is not in the uninterrupted arm's logs")
        elif value != want:
            verdict.problems.append(f"{arm}: {tag} at step {step} is {value!r}, the uninterrupted arm's {want!r}")
    missing = [(tag, step) for tag, series in reference.items() for step in series if (tag, step) not in seen]
    if missing:
        verdict.problems.append(
            f"{arm}: {len(missing)} values of the uninterrupted arm never logged, e.g. {missing[0]}"
        )
    verdict.values = len(logged)


def judge_arm(
    arm: str,
    runs: list[JobRun],
    endings: list[dict],
    fired: list[Fired],
    injected: list[Fault],
    *,
    clock_s: float,
    watchdog: tuple[float, float],
    max_restarts: int,
    began: dict[tuple[int, int], float],
) -> ArmVerdict:
    """The checks of the job runs and their endings; `watchdog` is (floor_s, factor); `began` when each job run
    (job, restart) was first seen running."""
    v = ArmVerdict()
    if len(runs) != len(endings):
        v.problems.append(f"{arm}: {len(runs)} job runs in the log but {len(endings)} endings in endings.jsonl")
    gaps = [g for run in runs for g in run.gaps()]
    max_gap = max(gaps, default=0.0)
    allowed = clock_s + 2 * max_gap  # the step crossing the interval, and the step and save in flight at the fault
    usual_timeout = max(watchdog[0], watchdog[1] * statistics.median(gaps)) if gaps else watchdog[0]
    by_run = {f.run: f for f in fired}
    unexplained = list(injected)
    for i, (run, ending) in enumerate(zip(runs, endings, strict=False)):
        where = f"{arm}: job {run.job} run {run.restart}"
        got = ending["class"]
        if any(s in run.text for s in NEVER):
            v.problems.append(f"{where}: torchrun's own signal handling in the log ({' or '.join(NEVER)})")
        if i == len(runs) - 1:
            if got != "finished" or ending.get("step") is None:
                v.problems.append(f"{where}: the last run ended {got}, not finished")
            continue
        hit = by_run.get(i)
        if hit is not None:
            kind, fail_at = hit.fault.kind, hit.at
            if got != ENDS_AS[kind]:
                v.problems.append(
                    f"{where}: ended {got} ({ending.get('cause')}) after {hit.fault}, not {ENDS_AS[kind]}"
                )
        else:
            match = [
                f
                for f in unexplained
                if ENDS_AS[f.kind] == got
                and f.step == ending.get("step")
                and (f.kind != "crash" or "TEST CRASH" in ending["cause"])
            ]
            if not match:
                v.problems.append(
                    f"{where}: ended {got} at step {ending.get('step')} ({ending.get('cause')}), no fault's doing"
                )
                continue
            unexplained.remove(match[0])
            kind, fail_at = match[0].kind, run.last_progress
        for line in SAID.get(kind, ()):
            if line not in run.text:
                v.problems.append(f"{where}: {kind}, but the log does not say {line!r}")
        if got == "preempted" and "Traceback" in run.text:
            v.problems.append(f"{where}: a preemption with a traceback in the log")
        if kind in RESTARTED:
            v.restarts += 1
            if f"restart {v.restarts} of {max_restarts}" not in run.text:
                v.problems.append(f"{where}: {kind}, but no 'restart {v.restarts} of {max_restarts}' in the log")
        nxt = runs[i + 1]
        if nxt.resumed is None or run.resumed is None or fail_at is None:
            v.problems.append(f"{where}: ended {got}, but it or the next run never began training")
            continue
        if nxt.resumed < run.resumed:
            v.problems.append(
                f"{where}: the next run resumed from step {nxt.resumed}, older than this run's {run.resumed}"
            )
        lost_steps = run.last_step - nxt.resumed
        since = run.step_time(nxt.resumed) if nxt.resumed > run.resumed else run.started
        lost_s = max(0.0, fail_at - since) if since is not None else float("nan")
        if got == "preempted" and lost_steps != 0:
            v.problems.append(f"{where}: preempted at step {run.last_step}, resumed from step {nxt.resumed}: work lost")
        elif not lost_s <= allowed:
            v.problems.append(f"{where}: {lost_s:.1f} s of work lost, over the {allowed:.1f} s the clock allows")
        timeout = float(m.group(1)) if got == "hung" and (m := TIMEOUT.search(run.text)) else usual_timeout
        quiet = ending["time"] - max(run.last_progress or 0.0, hit.at if hit else 0.0)
        if not quiet <= timeout + HANG_GRACE_S:
            v.problems.append(
                f"{where}: ended {quiet:.0f} s after its last progress, over {timeout:.0f} + {HANG_GRACE_S:.0f} s"
            )
        back = next((t for r in runs[i + 1 :] for s, t in r.steps if s > run.last_step), None)
        v.outcomes.append(
            Outcome(
                arm=arm,
                fault=str(hit.fault) if hit else str(match[0]),
                kind=kind,
                ended=got,
                lost_steps=lost_steps,
                lost_s=lost_s,
                allowed_s=allowed,
                queued_s=began[(nxt.job, nxt.restart)] - fail_at if (nxt.job, nxt.restart) in began else None,
                ended_s=quiet,
                bound_s=timeout + HANG_GRACE_S,
                restart_s=nxt.started - fail_at if nxt.started else None,
                recover_s=back - fail_at if back else None,
            )
        )
    for f in unexplained:
        v.problems.append(f"{arm}: {f} never happened")
    if v.restarts > max_restarts:
        v.problems.append(f"{arm}: {v.restarts} restarts, over the budget of {max_restarts}")
    missing = [f for f in fired if f.run >= len(runs) - 1]
    v.problems += [f"{arm}: {f.fault} hit the last job run, which finished anyway" for f in missing]
    return v


def external(faults: list[Fault], arm: str) -> list[Fault]:
    return [f for f in faults if f.kind in EXTERNAL and f.arm == arm]
