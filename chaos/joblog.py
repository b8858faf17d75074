"""One arm's Slurm log (appended over its requeues), split into the job's runs: when each began training, from which
step, which steps and checkpoints it logged and when (the trainer's own time stamps), and its text.

The standard library only.
"""

from __future__ import annotations

import dataclasses
import re
from datetime import datetime

RUN_START = re.compile(r"^launch/slurm\.sbatch: job (\d+) \(restart (\d+)\)", re.M)
STAMP = r"\[rank0\]:\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) - \S+ - \w+ - "
TRAINING = re.compile(STAMP + r"Training starts at step (\d+)$", re.M)
STEP = re.compile(STAMP + r"step (\d+)/(\d+)  loss", re.M)
SAVED = re.compile(STAMP + r"\S*/step-(\d+): written", re.M)


def stamp(text: str) -> float:
    """A log time stamp (this machine's local time) as a Unix time."""
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


@dataclasses.dataclass
class JobRun:
    job: int
    restart: int  # Slurm's restart count of the job
    text: str
    started: float | None = None  # the trainer's "Training starts" line
    resumed: int | None = None  # the step its checkpoint held (0: none)
    steps: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (step, when logged)
    saves: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (step, when complete)

    @property
    def last_step(self) -> int | None:
        """The last step this run logged (its resumed step where it logged none)."""
        return self.steps[-1][0] if self.steps else self.resumed

    @property
    def last_progress(self) -> float | None:
        """When this run last logged a step or a checkpoint (else began training)."""
        times = [t for _, t in self.steps + self.saves]
        return max(times) if times else self.started

    def step_time(self, step: int) -> float | None:
        return next((t for s, t in self.steps if s == step), None)

    def gaps(self) -> list[float]:
        """Seconds between consecutive step lines (the first from the start of training): a step with what came
        after it (its checkpoint, its validation)."""
        times = [self.started] + [t for _, t in self.steps] if self.started else [t for _, t in self.steps]
        return [b - a for a, b in zip(times, times[1:], strict=False)]


def job_runs(text: str) -> list[JobRun]:
    """The runs of the job, in order."""
    starts = list(RUN_START.finditer(text))
    runs = []
    for i, m in enumerate(starts):
        part = text[m.start() : starts[i + 1].start() if i + 1 < len(starts) else len(text)]
        run = JobRun(job=int(m.group(1)), restart=int(m.group(2)), text=part)
        if t := TRAINING.search(part):
            run.started, run.resumed = stamp(t.group(1)), int(t.group(2)) - 1
        run.steps = [(int(s.group(2)), stamp(s.group(1))) for s in STEP.finditer(part)]
        run.saves = [(int(s.group(2)), stamp(s.group(1))) for s in SAVED.finditer(part)]
        runs.append(run)
    return runs
