"""What a resume must reproduce, measured: every compared value of the steps after the checkpoint, in the killed
job (uninterrupted through them), the resumed job and, where there is one, the rerun (a second relaunch from the
same checkpoint over the same steps). The verdict on these figures is verdicts.resume_verdict."""

from __future__ import annotations

import math
from typing import Any

# What a resumed step must reproduce: the loss and its parts, the gradient norm, every LR, the tokens, every
# data counter (the loader's position), the routing statistics and the validation of the raw and EMA weights (at
# the kill step: the EMA's restore shows nowhere else); not the timings and memory, which differ between any two jobs.
COMPARED = ("train/loss", "train/ce", "train/z_loss", "train/loss_max", "grad_norm", "tokens_seen")
COMPARED_PREFIXES = ("lr/", "data/", "mhar", "val/")
FORWARD = ("train/loss", "train/ce", "train/z_loss", "train/loss_max")
# The counters follow the step, not the arithmetic: identical in any two runs of a correct resume, on any GPU.
COUNTERS = ("lr/", "data/", "tokens_seen")
# Where two relaunches are not bitwise equal, the spread rule judges these: every loss, the gradient norm and the
# validation CEs (the whole state shows in them). Not the routing statistics: the gates are near 0 and Adam
# scales their noisy gradients to full steps, so two relaunches differ in them by up to their own size (measured
# 0.98 of a gate's value on an H100 after 10 steps, against 5e-5 in the loss); they are reported, and judged
# exactly where the GPUs repeat the job bit for bit.
JUDGED = (*FORWARD, "grad_norm")
JUDGED_PREFIXES = ("val/",)

Scalars = dict[str, dict[int, float]]


def compared_tags(scalars: Scalars) -> list[str]:
    return sorted(t for t in scalars if t in COMPARED or t.startswith(COMPARED_PREFIXES))


def _differences(killed: Scalars, other: Scalars, tags: list[str], steps: list[int]) -> list[dict[str, Any]]:
    return [
        {"step": step, "tag": tag, "killed": killed[tag][step], "resumed": other.get(tag, {}).get(step)}
        for tag in tags
        for step in steps
        if step in killed.get(tag, {}) and killed[tag][step] != other.get(tag, {}).get(step)
    ]


def gap(a: Scalars, b: Scalars, tags: list[str], steps: list[int], scale: dict[str, float]) -> dict[str, Any]:
    """How far two runs of the same steps are apart: each value's difference over its tag's scale (the largest |value|
    of the tag in the killed job), as the root mean square over every (step, tag) both logged (the figure the
    verdict compares: many values, so two draws of GPU noise give similar figures), the same per step, and the
    largest single difference with its step and tag."""
    by_step: dict[int, list[float]] = {}
    worst_at: dict[int, tuple[float, str]] = {}
    worst = (0.0, None, None)
    for tag in tags:
        for step in steps:
            x, y = a.get(tag, {}).get(step), b.get(tag, {}).get(step)
            if x is None or y is None:
                continue
            d = abs(x - y) / scale[tag] if math.isfinite(x) and math.isfinite(y) else math.inf
            if x == y:
                d = 0.0
            by_step.setdefault(step, []).append(d)
            if d > worst_at.get(step, (0.0, ""))[0]:
                worst_at[step] = (d, tag)
            if d > worst[0]:
                worst = (d, step, tag)
    values = [d for ds in by_step.values() for d in ds]
    rms = math.sqrt(sum(d * d for d in values) / len(values)) if values else 0.0
    return {
        "rms": rms,
        "by_step": {step: math.sqrt(sum(d * d for d in ds) / len(ds)) for step, ds in sorted(by_step.items())},
        "max": worst[0],
        "max_step": worst[1],
        "max_tag": worst[2],
        "worst_tag_by_step": {step: tag for step, (_, tag) in worst_at.items()},
        "values": len(values),
    }


def resume_check(killed: Scalars, resumed: Scalars, checkpoint_at: int, rerun: Scalars | None = None) -> dict[str, Any]:
    """Every compared value of every step after the checkpoint that the killed job (and the rerun, if any) logged,
    against the resumed job's; with a rerun, the three runs' gaps on those values (`gap`): resumed and rerun each
    against the killed job, and the rerun against the resumed job, the spread of two relaunches."""
    steps = sorted(s for s in killed.get("train/loss", {}) if s > checkpoint_at)
    if rerun is not None:
        steps = [s for s in steps if s in rerun.get("train/loss", {})]
    tags = compared_tags(killed)
    differ = _differences(killed, resumed, tags, steps)
    loss = [
        (abs(resumed["train/loss"][s] - killed["train/loss"][s]), abs(killed["train/loss"][s]))
        for s in steps
        if s in resumed.get("train/loss", {})
    ]
    first = steps[0] if steps else None
    check = {
        # the first resumed step's loss comes from the restored weights and data alone
        "first_step_identical": not any(d["step"] == first and d["tag"] in FORWARD for d in differ),
        "counters_identical": not any(d["tag"].startswith(COUNTERS) for d in differ),
        "max_abs_loss_diff": max((d for d, _ in loss), default=None),
        "max_rel_loss_diff": max((d / v for d, v in loss if v), default=None),
        "steps": steps,
        "tags": len(tags),
        "values": sum(len([s for s in steps if s in killed[t]]) for t in tags),
        "equal": bool(steps) and not differ,
        "differ": differ[:20],
        "differing_values": len(differ),
        "first_differing_step": min((d["step"] for d in differ), default=None),
        "rerun": None,
    }
    if rerun is None:
        return check
    floats = [t for t in tags if not t.startswith(COUNTERS)]
    judged = [t for t in floats if t in JUDGED or t.startswith(JUDGED_PREFIXES)]
    scale = {
        t: max((abs(v) for s, v in killed[t].items() if s in steps and math.isfinite(v)), default=0.0) or 1.0
        for t in floats
    }
    rerun_differ = _differences(killed, rerun, tags, steps)
    counters = [d for d in differ + [{**d, "run": "rerun"} for d in rerun_differ] if d["tag"].startswith(COUNTERS)]
    missing = [
        (d["step"], d["tag"], run)
        for run, ds in (("resumed job", differ), ("rerun", rerun_differ))
        for d in ds
        if d["resumed"] is None
    ]
    routing = [t for t in floats if t not in judged]
    check["rerun"] = {
        "equal": bool(steps) and not rerun_differ,
        "relaunches_equal": not _differences(resumed, rerun, tags, steps),
        "missing": sorted(missing)[:20],
        "counters": sorted(counters, key=lambda d: (d["step"], d["tag"]))[:20],
        "judged": len(judged),
        "resumed_gap": gap(resumed, killed, judged, steps, scale),
        "rerun_gap": gap(rerun, killed, judged, steps, scale),
        "spread": gap(resumed, rerun, judged, steps, scale),
        "routing_tags": len(routing),
        "routing_gap": gap(resumed, killed, routing, steps, scale)["max"],
        "routing_spread": gap(resumed, rerun, routing, steps, scale)["max"],
    }
    return check
