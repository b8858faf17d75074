"""Mixture stages: weights that change at given training steps (a constant mix, then an anneal mix).

    [data] mixture_stages = ["7601: web=0.3 hq=0.7"]     # from training step 7601 on; before it, the mixture's own

Stage 1 is the mixture's own weights, from step 1; each entry starts the next stage at a training step (never a
count of samples or windows, whose meaning changes with the batch) and names every source of the mixture (0 leaves
one out). A window's source is still picked by the mixture's low-discrepancy sequence of (seed, stream, window)
(data/mixture.py), against the weights of the stage its training step is in. Which step a window is in does not
depend on the number of ranks or loader workers: the global batch g of the run (counted over every rank's
microbatches in step order) is batch g // num_streams of stream g % num_streams, and belongs to step
g // (global batches a step) + 1 (data/loader.py deals the streams so). So a resume before, at or after a boundary,
on any number of ranks, continues the same windows from the same sources.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from data.config import DataConfig


@dataclass(frozen=True)
class Stage:
    number: int  # 1: the mixture's own weights
    start: int  # its first training step
    weights: tuple[float, ...]  # per source, in the mixture's order


def _entry_error(number: int, spec: str, what: str) -> ValueError:
    return ValueError(f"[data] mixture_stages entry {spec!r} (stage {number}): {what}")


def _parse_weights(number: int, spec: str, body: str, names: list[str]) -> tuple[float, ...]:
    weights: dict[str, float] = {}
    for item in body.split():
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise _entry_error(number, spec, f"{item!r} is not name=weight")
        if name not in names:
            raise _entry_error(number, spec, f"no mixture source {name!r} (the sources: {', '.join(names)})")
        if name in weights:
            raise _entry_error(number, spec, f"source {name!r} named twice")
        try:
            w = float(value)
        except ValueError:
            raise _entry_error(number, spec, f"weight {value!r} of {name!r} is not a number") from None
        if not (math.isfinite(w) and w >= 0):
            raise _entry_error(number, spec, f"weight {w} of {name!r} must be finite and >= 0 (0 leaves it out)")
        weights[name] = w
    missing = [n for n in names if n not in weights]
    if missing:
        raise _entry_error(number, spec, f"no weight for {', '.join(missing)}: name every source (0 leaves one out)")
    if not any(weights.values()):
        raise _entry_error(number, spec, "every weight is 0")
    return tuple(weights[n] for n in names)


def parse_stages(cfg: DataConfig, names: list[str], weights: list[float], last_step: int | None) -> list[Stage]:
    """The run's stages: stage 1 (from step 1, `weights`, the mixture's own), then `[data] mixture_stages`.
    `names`: the mixture's sources in order; `last_step`: the last step of the run's schedule (None: unchecked).
    A ValueError names the stage, its entry and the value."""
    stages = [Stage(1, 1, tuple(weights))]
    if cfg.mixture_stages and not cfg.mixture:
        raise ValueError("[data] mixture_stages change the weights of a mixture: set [data] mixture (named sources)")
    for spec in cfg.mixture_stages:
        number = len(stages) + 1
        head, sep, body = spec.partition(":")
        if not sep:
            raise _entry_error(number, spec, "expected 'STEP: name=weight name=weight ...'")
        try:
            start = int(head.strip())
        except ValueError:
            raise _entry_error(number, spec, f"step {head.strip()!r} is not a whole number") from None
        if start <= stages[-1].start:
            where = "step 1 (the mixture's own weights)" if len(stages) == 1 else f"step {stages[-1].start}"
            raise _entry_error(number, spec, f"starts at step {start}, not after stage {len(stages)}'s {where}")
        if last_step is not None and start > last_step:
            raise _entry_error(number, spec, f"starts at step {start}, past the run's last step {last_step}")
        stages.append(Stage(number, start, _parse_weights(number, spec, body, names)))
    return stages


class StageSchedule:
    """The weights in force at each training step."""

    def __init__(self, stages: list[Stage]):
        self.stages = stages
        self._starts = [s.start for s in stages]

    def at(self, step: int) -> Stage:
        return self.stages[max(0, bisect.bisect_right(self._starts, step) - 1)]

    @property
    def staged(self) -> bool:
        """More than the mixture's own weights."""
        return len(self.stages) > 1

    def describe(self, names: list[str]) -> list[dict]:
        """[{number, start, weights {name: normalised weight}}]: for logs, the fingerprint and reports."""
        return [
            {"number": s.number, "start": s.start, "weights": dict(zip(names, _normalised(s.weights), strict=True))}
            for s in self.stages
        ]


def _normalised(weights: tuple[float, ...]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


def step_of_batch(k: int, accumulation: int) -> int:
    """The training step of a rank's k-th microbatch (counted from the run's start): each step takes
    `accumulation` microbatches of every rank."""
    return k // accumulation + 1


def stream_batches_before(step: int, stream: int, num_streams: int, global_per_step: int) -> int:
    """How many batches stream `stream` has delivered before training step `step`, on any number of ranks:
    `global_per_step` microbatches a step over all ranks, the run's global batch g from stream g % num_streams."""
    before = (step - 1) * global_per_step
    return max(0, -(-(before - stream) // num_streams))
