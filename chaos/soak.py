"""The chaos soak: the tiny pair under a real one-node Slurm (chaos/slurm.py), submitted by `launch/pair.sh --slurm`
as a user does, with faults at random moments (chaos/schedule.py), round after round for a set number of minutes;
each round is judged against one uninterrupted pair of the same settings (chaos/verdict.py).

    python -m chaos.soak [--minutes 20] [--seed S] [--steps 40] [--faults 3] [--dir DIR]    (make soak)

It prints its seed and each round's faults before the round starts (`--seed S` draws the same schedule again), each
fault as it is done, and a summary: faults survived, work lost against what the clock allows, time to recover.
Exit 0 when every check of every round holds, 1 naming each one that does not, 2 when no cluster can start here
(it needs root and Debian's slurmctld, slurmd and slurm-client).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from chaos.joblog import JobRun, job_runs
from chaos.schedule import ARMS, CLEAR, EXTERNAL, INJECTED, Fault, draw
from chaos.slurm import ENDED, SlurmCluster, unavailable
from chaos.verdict import ArmVerdict, Fired, compare_values, external, judge_arm
from mhar_titan.components.checkpoint.testing import CRASH_ENV, HANG_ENV
from mhar_titan.components.endings import read_endings

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("configs/tiny_cpu.toml", "configs/tiny_cpu_mhar.toml")
POLL_S = 0.25
SEAM = {"crash": CRASH_ENV, "hang": HANG_ENV}


@dataclasses.dataclass(frozen=True)
class Settings:
    """A round's arms: the tiny pair cut to `steps`, a checkpoint every `save_every` steps and by the clock every
    `clock_minutes`, the watchdog's floor and factor small enough for a CPU step."""

    steps: int = 40
    save_every: int = 10
    clock_minutes: float = 0.1
    external_per_arm: int = 3
    floor_s: float = 10.0
    factor: float = 3.0
    first_step_s: float = 120.0
    backoff_s: float = 1.0

    def overrides(self) -> list[str]:
        """What every arm of the soak runs with, the uninterrupted reference too."""
        s = str
        return [
            *("--training.steps", s(self.steps), "--lr_scheduler.total_steps", s(self.steps)),
            *("--lr_scheduler.warmup_steps", "2", "--ema.beta", "0.8"),
            *("--checkpoint.interval", s(self.save_every), "--checkpoint.interval_minutes", s(self.clock_minutes)),
            *("--validation.freq", s(self.save_every), "--validation.steps", "1"),
            *("--watchdog.floor_s", s(self.floor_s), "--watchdog.factor", s(self.factor)),
            *("--watchdog.first_step_s", s(self.first_step_s), "--job.restart_backoff_s", s(self.backoff_s)),
        ]


def job_env(python: str) -> dict[str, str]:
    return {"PYTHON": python, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def pair_sh(
    cluster: SlurmCluster, name: str, runs: Path, logs: Path, overrides: list[str], env: dict[str, str], *dry: str
) -> subprocess.CompletedProcess:
    sbatch = f"--gpus-per-node=0 --output={logs}/%x-%j.out"
    env = {**cluster.env, **env, "RUNS_DIR": str(runs), "SBATCH_ARGS": sbatch}
    argv = ["launch/pair.sh", "--slurm", *dry, name, *CONFIGS, *overrides]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"launch/pair.sh --slurm {' '.join(dry)} {name}: {done.stderr.strip()}")
    return done


def submit_pair(
    cluster: SlurmCluster, name: str, runs: Path, logs: Path, overrides: list[str], env: dict[str, str]
) -> dict[str, tuple[int, Path]]:
    """`launch/pair.sh --slurm`: each arm's job id and log."""
    done = pair_sh(cluster, name, runs, logs, overrides, env)
    jobs = [int(j) for j in re.findall(r"Submitted batch job (\d+)", done.stdout)]
    if len(jobs) != 2:
        raise RuntimeError(f"launch/pair.sh --slurm {name} submitted {jobs}: {done.stdout} {done.stderr}")
    return {arm: (job, logs / f"{name}-{arm}-{job}.out") for arm, job in zip(ARMS, jobs, strict=True)}


def resubmit(cluster: SlurmCluster, command: str, env: dict[str, str]) -> int:
    """An arm submitted again with its own command (`launch/pair.sh --slurm --dry-run` prints it), as an operator
    resumes an arm that a cancellation ended: its job id."""
    full = {**cluster.env, **env}
    done = subprocess.run(["bash", "-c", command], cwd=REPO, env=full, capture_output=True, text=True)
    found = re.findall(r"Submitted batch job (\d+)", done.stdout)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"{command}: {done.stderr.strip() or done.stdout.strip()}")
    return int(found[0])


def reference(cluster: SlurmCluster, root: Path, settings: Settings, python: str) -> Path:
    """The uninterrupted pair: the values every round must repeat."""
    (root / "logs").mkdir(parents=True, exist_ok=True)
    jobs = submit_pair(cluster, "reference", root, root / "logs", settings.overrides(), job_env(python))
    for arm, (job, log) in jobs.items():
        fields = cluster.wait(job, timeout_s=600 + 10 * settings.steps)
        if (fields["JobState"], fields["ExitCode"]) != ("COMPLETED", "0:0"):
            tail = log.read_text()[-3000:] if log.exists() else "(no log)"
            raise RuntimeError(f"the uninterrupted {arm} arm ended {fields['JobState']} {fields['ExitCode']}: {tail}")
    return root / "reference"


def workers(job: int) -> dict[int, int]:
    """{rank: pid} of the job's training processes on this node (torchrun's workers carry RANK and the job's id)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if env.get(b"SLURM_JOB_ID") == str(job).encode() and b"RANK" in env and b"train_cpt.py" in cmd:
            found[int(env[b"RANK"])] = int(pid)
    return found


def do(cluster: SlurmCluster, job: int, fault: Fault) -> bool:
    """The external fault, done to the job; False where there was nothing to do it to (retried)."""
    if fault.kind == "kill":
        pid = workers(job).get(fault.rank)
        if pid is None:
            return False
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True
    command = {
        "term": ("scancel", str(job)),  # SIGTERM to every process, KillWait, the job ended for good
        "requeue": ("scontrol", "requeue", str(job)),
        "warning": ("scancel", "--signal=USR1", "--batch", str(job)),
    }[fault.kind]
    return cluster.run(*command, check=False).returncode == 0


@dataclasses.dataclass
class Arm:
    """One arm's jobs as the driver follows them: its first job, and one more after each cancellation."""

    name: str
    jobs: list[tuple[int, Path]]  # (job id, log)
    command: str  # the arm's sbatch command, for a resubmission
    run_dir: Path
    todo: list[Fault]  # external faults not yet done, in order
    injected: list[Fault]
    fired: list[Fired] = dataclasses.field(default_factory=list)
    began: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)  # (job, restart): seen running
    fire_at: float | None = None
    state: str = "PENDING"

    @property
    def job(self) -> int:
        return self.jobs[-1][0]

    def runs(self) -> list[JobRun]:
        return [run for _, log in self.jobs if log.exists() for run in job_runs(log.read_text())]

    def poll(self, cluster: SlurmCluster, env: dict[str, str], say) -> None:
        fields = cluster.kick(self.job)
        self.state = fields["JobState"]
        if self.state == "RUNNING":
            self.began.setdefault((self.job, int(fields["Restarts"])), time.time())
        last = self.fired[-1] if self.fired else None
        if self.state in ENDED and last and last.fault.kind == "term" and last.job == self.job:
            job = resubmit(cluster, self.command, env)
            self.jobs.append((job, self.jobs[0][1].with_name(f"{self.jobs[0][1].name.rsplit('-', 1)[0]}-{job}.out")))
            say(f"  {time.strftime('%H:%M:%S')} {self.name}: job {last.job} {self.state}; submitted again as job {job}")
            self.state = "PENDING"
            return
        if not self.todo or self.state != "RUNNING":
            self.fire_at = None
            return
        runs = self.runs()
        run = runs[-1] if runs else None
        if run is None or run.job != self.job or not run.steps or any(f.run == len(runs) - 1 for f in self.fired):
            self.fire_at = None  # one fault a job run
            return
        step, fault, endings = run.last_step, self.todo[0], read_endings(str(self.run_dir))
        if len(endings) >= len(runs):
            self.fire_at = None  # this run has ended (its launcher is deciding): the fault goes to the next
            return
        done = {(e["class"], e.get("step")) for e in endings}
        ahead = [f for f in self.injected if (("crashed" if f.kind == "crash" else "hung"), f.step) not in done]
        if step < fault.step or any(step <= f.step <= step + CLEAR for f in ahead):
            return  # not there yet, or an injected fault comes first
        if self.fire_at is None:
            gaps = [g for r in runs for g in r.gaps()]
            self.fire_at = time.time() + fault.delay * (statistics.median(gaps) if gaps else 1.0)
        if time.time() >= self.fire_at and do(cluster, self.job, fault):
            self.fired.append(Fired(fault, time.time(), len(runs) - 1, step, self.job))
            say(f"  {time.strftime('%H:%M:%S')} {fault} (done after step {step}, job {self.job} run {len(runs) - 1})")
            self.todo.pop(0)
            self.fire_at = None


@dataclasses.dataclass
class Round:
    seed: int
    faults: list[Fault]
    verdicts: dict[str, ArmVerdict]
    seconds: float

    @property
    def problems(self) -> list[str]:
        return [p for v in self.verdicts.values() for p in v.problems]


def run_round(
    cluster: SlurmCluster,
    root: Path,
    name: str,
    reference_dir: Path,
    settings: Settings,
    seed: int,
    python: str,
    say=print,
) -> Round:
    """One faulted pair, followed to its end, and judged."""
    began = time.monotonic()
    faults = draw(seed, settings.steps, settings.save_every, settings.external_per_arm)
    say(f"round {name}: seed {seed}, {len(faults)} faults:")
    for f in faults:
        say(f"  {f}")
    budget = max(sum(1 for f in faults if f.kind in ("kill", *INJECTED) and f.arm in (arm, None)) for arm in ARMS)
    env = job_env(python)
    for kind in INJECTED:
        env[SEAM[kind]] = ",".join(f.env_entry() for f in faults if f.kind == kind)
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    overrides = [*settings.overrides(), "--job.max_restarts", str(budget)]
    jobs = submit_pair(cluster, name, root, logs, overrides, env)
    commands = pair_sh(cluster, name, root, logs, overrides, env, "--dry-run").stdout.splitlines()
    injected = [f for f in faults if f.kind in INJECTED]
    arms = [
        Arm(arm, [jobs[arm]], command, root / name / arm, external(faults, arm), injected)
        for arm, command in zip(ARMS, commands, strict=True)
    ]
    deadline = time.monotonic() + 300 + 6 * settings.steps + 120 * len(faults)
    while not all(a.state in ENDED for a in arms):
        if time.monotonic() > deadline:
            for a in arms:
                cluster.run("scancel", str(a.job), check=False)
            raise TimeoutError(
                f"round {name} (seed {seed}) not done after {deadline - began:.0f} s: {arms_states(arms)}"
            )
        for a in arms:
            a.poll(cluster, env, say)
        time.sleep(POLL_S)
    verdicts = {}
    for a in arms:
        fields = cluster.job(a.job)
        v = judge_arm(
            a.name,
            a.runs(),
            read_endings(str(a.run_dir)),
            a.fired,
            injected,
            clock_s=settings.clock_minutes * 60,
            watchdog=(settings.floor_s, settings.factor),
            max_restarts=budget,
            began=a.began,
        )
        if (fields["JobState"], fields["ExitCode"]) != ("COMPLETED", "0:0"):
            v.problems.insert(0, f"{a.name}: the job ended {fields['JobState']} {fields['ExitCode']}")
        for job, _ in a.jobs[:-1]:  # each ended by a cancellation, and submitted again
            if (state := cluster.job(job)["JobState"]) != "CANCELLED":
                v.problems.insert(0, f"{a.name}: job {job} ended {state}, not CANCELLED by the fault")
        v.problems += [f"{a.name}: {f} never done" for f in a.todo]
        compare_values(a.name, a.run_dir, reference_dir / a.name, v)
        verdicts[a.name] = v
    return Round(seed, faults, verdicts, time.monotonic() - began)


def arms_states(arms: list[Arm]) -> str:
    return ", ".join(f"{a.name} job {a.job} {a.state}, {len(a.todo)} faults to do" for a in arms)


def _s(x: float | None) -> str:
    return f"{x:.1f}" if x is not None else "-"


def summary(rounds: list[Round]) -> tuple[list[str], dict]:
    """The lines the soak ends with, and the same as data."""
    outcomes = [o for r in rounds for v in r.verdicts.values() for o in v.outcomes]
    problems = [p for r in rounds for p in r.problems]
    faults = sum(len(r.faults) + sum(1 for f in r.faults if f.arm is None) for r in rounds)  # injected: both arms
    head = ("arm", "fault", "ended", "lost", "lost s", "allowed", "queued", "restart", "recover")
    row = "{:8} {:54} {:9} {:>4} {:>6} {:>7} {:>6} {:>7} {:>7}"
    lines = [row.format(*head)]
    for o in outcomes:
        cells = (o.arm, o.fault.split(": ", 1)[1], o.ended, o.lost_steps, f"{o.lost_s:.1f}", f"{o.allowed_s:.1f}")
        lines.append(row.format(*cells, _s(o.queued_s), _s(o.restart_s), _s(o.recover_s)))

    def spread(xs: list[float | None]) -> str:
        xs = [x for x in xs if x is not None]
        return f"median {statistics.median(xs):.1f} s, max {max(xs):.1f} s" if xs else "none"

    values = sum(v.values for r in rounds for v in r.verdicts.values())
    kinds = ", ".join(f"{k} {sum(o.kind == k for o in outcomes)}" for k in (*EXTERNAL, *INJECTED))
    preempted = sum(o.lost_steps for o in outcomes if o.ended == "preempted")
    lines += [
        f"rounds: {len(rounds)} ({', '.join(f'seed {r.seed}, {r.seconds / 60:.1f} min' for r in rounds)})",
        f"faults survived: {len(outcomes)} of {faults} ({kinds})",
        f"work lost: {spread([o.lost_s for o in outcomes])} (allowed at most "
        f"{max((o.allowed_s for o in outcomes), default=0):.1f} s); by preemptions: {preempted} steps",
        f"from the fault: the next job run on the node {spread([o.queued_s for o in outcomes])}; training again "
        f"{spread([o.restart_s for o in outcomes])}; past the step reached {spread([o.recover_s for o in outcomes])}",
        f"each faulted job run ended {spread([o.ended_s for o in outcomes])} after its last progress (the watchdog "
        f"allows {min((o.bound_s for o in outcomes), default=0):.0f} s or more)",
        f"values compared with the uninterrupted pair: {values}" + (", every one equal" if values else ""),
        f"verdict: {'PASS' if not problems else f'FAIL ({len(problems)} problems)'}",
    ]
    data = {
        "rounds": [{"seed": r.seed, "faults": [str(f) for f in r.faults], "seconds": r.seconds} for r in rounds],
        "outcomes": [dataclasses.asdict(o) for o in outcomes],
        "problems": problems,
    }
    return lines, data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="rounds start until this many minutes have passed")
    parser.add_argument("--seed", type=int, default=None, help="the first round's seed (default: drawn, and printed)")
    parser.add_argument("--steps", type=int, default=Settings.steps, help="each arm's steps")
    parser.add_argument("--faults", type=int, default=Settings.external_per_arm, help="external faults an arm a round")
    parser.add_argument("--dir", type=Path, default=None, help="the soak's folder (default: a new temporary one)")
    args = parser.parse_args(argv)
    why = unavailable()
    if why is not None:
        print(f"chaos.soak: no Slurm here: {why}", file=sys.stderr)
        return 2
    if args.minutes < 0:
        print(f"chaos.soak: --minutes {args.minutes:g}: a number of minutes, 0 or more (0: one round)", file=sys.stderr)
        return 2
    if args.steps < 12 or args.faults < 1:
        print(
            f"chaos.soak: --steps {args.steps} --faults {args.faults}: at least 12 steps and 1 fault", file=sys.stderr
        )
        return 2
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    settings = Settings(steps=args.steps, save_every=max(4, args.steps // 4), external_per_arm=args.faults)
    try:
        draw(seed, settings.steps, settings.save_every, settings.external_per_arm)
    except ValueError as e:
        print(f"chaos.soak: {e}", file=sys.stderr)
        return 2
    root = args.dir or Path(tempfile.mkdtemp(prefix="mhar-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"chaos.soak: seed {seed}, {args.minutes:g} minutes, {settings}; in {root}", flush=True)
    cluster = SlurmCluster(root / "slurm")
    rounds: list[Round] = []
    try:
        cluster.start()
        began = time.monotonic()
        ref = reference(cluster, root, settings, sys.executable)
        print(f"the uninterrupted pair: {(time.monotonic() - began) / 60:.1f} min", flush=True)
        while not rounds or time.monotonic() - began < args.minutes * 60:
            r = run_round(cluster, root, f"round{len(rounds)}", ref, settings, seed + len(rounds), sys.executable)
            rounds.append(r)
            print(f"round {len(rounds) - 1}: {r.seconds / 60:.1f} min, {len(r.problems)} problems", flush=True)
            for p in r.problems:
                print(f"  {p}", flush=True)
    except (RuntimeError, TimeoutError) as e:
        print(f"chaos.soak: {e} (replay: --seed {seed + len(rounds)})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            f"chaos.soak: interrupted in round {len(rounds)} (seed {seed + len(rounds)}); the cluster stopped",
            file=sys.stderr,
        )
        return 130
    finally:
        cluster.stop()
    lines, data = summary(rounds)
    print("\n".join(lines))
    (root / "soak.json").write_text(
        json.dumps(data | {"seed": seed, "settings": dataclasses.asdict(settings)}, indent=1)
    )
    if data["problems"]:
        print(f"replay a failing round: python -m chaos.soak --seed SEED --steps {args.steps} --faults {args.faults}")
    return 1 if data["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
