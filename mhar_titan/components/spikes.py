"""Loss and gradient-norm spikes, scored as they happen: each step's value against the median and the median
absolute deviation (MAD) of the previous `window` steps' values, a robust z-score that one earlier spike does not
move. A step scoring above `threshold` is a spike: a warning line, TensorBoard scalars at its step, a line in
<dump_folder>/spikes.jsonl (the run's record of them, which the pair's comparison reads), and, with
`keep_checkpoint_before`, the newest complete checkpoint before it kept out of retention.

The windows are part of the trainer's checkpointed state, so a resumed job scores every step as the uninterrupted
job did; spikes.jsonl is cut back to the resumed step at start, as TensorBoard's purge cuts its scalars.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from data.atomic import write_text

FILE = "spikes.jsonl"
TAGS = ("loss", "grad_norm")
MAD_TO_SD = 1.4826  # the MAD of a normal distribution times this is its standard deviation


@dataclass
class Spike:
    step: int
    tag: str
    value: float
    median: float
    scale: float  # MAD_TO_SD x the MAD (at least a millionth of |median|)
    score: float
    kept_checkpoint: int | None = None

    def line(self, threshold: float, window: int) -> str:
        kept = "" if self.kept_checkpoint is None else f"; checkpoint step-{self.kept_checkpoint} kept out of retention"
        return (f"step {self.step}: {self.tag} spike, {self.value:.4g} against a median of {self.median:.4g} over the "
                f"last {window} steps (robust score {self.score:.1f}, threshold {threshold:g}){kept}")  # fmt: skip


class SpikeMonitor:
    def __init__(self, window: int, min_history: int, threshold: float):
        self.window, self.min_history, self.threshold = window, min_history, threshold
        self.history = {tag: deque(maxlen=window) for tag in TAGS}
        self.count = {tag: 0 for tag in TAGS}
        self.scores: dict[str, float] = {}  # the last step's, for its log line

    def observe(self, step: int, values: dict[str, float]) -> list[Spike]:
        """Score this step's finite values against the steps before, then add them to the windows (a spike too:
        the median and MAD hardly move for one value, and a lasting shift becomes the new normal)."""
        spikes, self.scores = [], {}
        for tag in TAGS:
            x = values[tag]
            if not math.isfinite(x):  # a bad step: skipped and counted elsewhere (components/bad_steps.py)
                continue
            past = self.history[tag]
            if len(past) >= self.min_history:
                median = statistics.median(past)
                scale = max(MAD_TO_SD * statistics.median(abs(v - median) for v in past), 1e-6 * abs(median), 1e-12)
                score = (x - median) / scale
                self.scores[tag] = score
                if score > self.threshold:
                    self.count[tag] += 1
                    spikes.append(Spike(step, tag, x, median, scale, score))
            past.append(x)
        return spikes

    def metrics(self) -> dict[str, float]:
        """TensorBoard scalars of a log step: the spikes so far and this step's scores."""
        out = {f"spikes/{tag}_count": float(n) for tag, n in self.count.items()}
        out.update({f"spikes/{tag}_score": s for tag, s in self.scores.items()})
        return out

    def state(self) -> str:
        """The windows and counts as JSON, for the trainer's checkpointed state (plain data, no pickle)."""
        return json.dumps({"window": self.window, "history": {t: list(h) for t, h in self.history.items()},
                           "count": self.count})  # fmt: skip

    def load(self, state: str) -> None:
        saved = json.loads(state)
        for tag in TAGS:  # a resume with another window keeps the newest values that fit
            self.history[tag] = deque(saved["history"][tag][-self.window :], maxlen=self.window)
            self.count[tag] = int(saved["count"][tag])


def newest_before(steps: list[int], step: int) -> int | None:
    """The newest complete checkpoint's step before `step` (the weights before the spike's update)."""
    return max((s for s in steps if s < step), default=None)


def read(folder: str) -> list[Spike]:
    """A run folder's recorded spikes, oldest first (none where it has no record)."""
    path = os.path.join(folder, FILE)
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [Spike(**json.loads(line)) for line in f if line.strip()]


def _write(folder: str, spikes: list[Spike]) -> None:
    write_text(os.path.join(folder, FILE), "".join(json.dumps(asdict(s)) + "\n" for s in spikes))


def append(folder: str, spikes: list[Spike]) -> None:
    """Rank 0: the record with these added, written atomically (a small file; a killed job loses no line)."""
    _write(folder, read(folder) + spikes)


def cut_back(folder: str, step: int) -> list[Spike]:
    """Rank 0, at start: drop the record's spikes after `step` (a killed job's steps past its checkpoint, which
    the resumed job scores again); the spikes kept."""
    kept = [s for s in read(folder) if s.step <= step]
    if os.path.isfile(os.path.join(folder, FILE)):
        _write(folder, kept)
    return kept


class RunSpikes:
    """The monitor in a job: scores each applied step, says so, records the spikes (rank 0), keeps the checkpoint
    before each out of retention where asked (rank 0, which purges), and restores all of that at a resume. With
    `[spikes] enable = false` every method does nothing."""

    def __init__(self, settings: Any, dump_folder: str, rank0: bool, say: Callable[[str], None],
                 checkpoints: Callable[[], list[int]]):  # fmt: skip
        self.enabled, self.keep_before = settings.enable, settings.keep_checkpoint_before
        self.monitor = SpikeMonitor(settings.window, settings.min_history, settings.threshold)
        self.folder, self.rank0, self.say, self.checkpoints = dump_folder, rank0, say, checkpoints
        self.kept: set[int] = set()  # the checkpoints kept for a spike: the checkpointer's purge leaves them

    def start(self, step: int) -> None:
        """After the load: the record cut back to the step resumed from, and the checkpoints it keeps."""
        if self.enabled and self.rank0:
            self.kept |= {s.kept_checkpoint for s in cut_back(self.folder, step) if s.kept_checkpoint is not None}

    def observe(self, step: int, loss: float, grad_norm: float) -> dict[str, float]:
        """An applied step's global loss and gradient norm; TensorBoard scalars for its step if it spiked."""
        spikes = self.monitor.observe(step, {"loss": loss, "grad_norm": grad_norm}) if self.enabled else []
        if spikes and self.rank0:
            before = newest_before(self.checkpoints(), step) if self.keep_before else None
            for s in spikes:
                s.kept_checkpoint = before
            self.kept |= {before} - {None}
            append(self.folder, spikes)
        for s in spikes:
            self.say(s.line(self.monitor.threshold, self.monitor.window))
        return {f"spikes/{s.tag}": s.value for s in spikes} | {f"spikes/{s.tag}_spike_score": s.score for s in spikes}

    def metrics(self) -> dict[str, float]:
        return self.monitor.metrics() if self.enabled else {}

    def state(self) -> dict[str, str]:
        """The trainer's checkpointed entry (none with scoring off)."""
        return {"spikes": self.monitor.state()} if self.enabled else {}

    def load(self, trainer_state: dict[str, Any]) -> None:
        if self.enabled:
            self.monitor.load(trainer_state["spikes"])


def summary(folder: str) -> dict[str, Any]:
    """Per tag: how many spikes the run recorded, at which steps, and the largest (by score)."""
    recorded = read(folder)
    out = {}
    for tag in TAGS:
        mine = [s for s in recorded if s.tag == tag]
        top = max(mine, key=lambda s: s.score, default=None)
        out[tag] = {
            "count": len(mine),
            "steps": [s.step for s in mine],
            "largest": None if top is None else asdict(top),
        }
    return out
