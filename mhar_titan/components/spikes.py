"""Loss and gradient-norm spikes, scored as they happen: each step's value against the median and the median
absolute deviation (MAD) of the previous `window` steps' values, a robust z-score that one earlier spike does not
move. A step scoring above `threshold` is a spike: a warning line, TensorBoard scalars at its step, a line in
<dump_folder>/spikes.jsonl (the run's record of them, which the pair's comparison reads), and, with
`keep_checkpoint_before`, the newest complete checkpoint before it kept out of retention.

The windows are part of the trainer's checkpointed state, so a resumed job scores every step as the uninterrupted
job did; spikes.jsonl is cut back to the resumed step at start, as TensorBoard's purge cuts its scalars. In a job
the hook components/run_spikes.py runs the monitor; this module, the score and the record, is what tools read.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import deque
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
        return (
            f"step {self.step}: {self.tag} spike, {self.value:.4g} against a median of {self.median:.4g} over the "
            f"last {window} steps (robust score {self.score:.1f}, threshold {threshold:g}){kept}"
        )


class SpikeMonitor:
    """`tags`: the values scored, by name (the loss and the gradient norm, and any a hook adds)."""

    def __init__(self, window: int, min_history: int, threshold: float, tags: tuple[str, ...] = TAGS):
        self.window, self.min_history, self.threshold, self.tags = window, min_history, threshold, tags
        self.history = {tag: deque(maxlen=window) for tag in tags}
        self.count = {tag: 0 for tag in tags}
        self.scores: dict[str, float] = {}  # the last step's, for its log line

    def observe(self, step: int, values: dict[str, float]) -> list[Spike]:
        """Score this step's finite values against the steps before, then add them to the windows (a spike too:
        the median and MAD hardly move for one value, and a lasting shift becomes the new normal)."""
        spikes, self.scores = [], {}
        for tag in self.tags:
            x = values.get(tag, math.nan)
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
        history = {t: list(h) for t, h in self.history.items()}
        return json.dumps({"window": self.window, "history": history, "count": self.count})

    def load(self, state: str) -> None:
        """A resume with another window keeps the newest values that fit; a tag the state lacks (a value scored
        from this start on) starts empty."""
        saved = json.loads(state)
        for tag in self.tags:
            self.history[tag] = deque(saved["history"].get(tag, [])[-self.window :], maxlen=self.window)
            self.count[tag] = int(saved["count"].get(tag, 0))


def newest_before(steps: list[int], step: int) -> int | None:
    """The newest complete checkpoint from before the first update that can carry a spike seen at `step`: that
    step's loss and gradient are those of the weights step - 1 updated, so the checkpoint of step - 1 may already
    hold the spiked update; the newest at step - 2 or earlier does not."""
    return max((s for s in steps if s < step - 1), default=None)


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
