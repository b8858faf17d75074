"""The arms at equal compute: MHAR costs more time a step, so at equal steps and tokens it has had more GPU-hours
than the control. From each arm's `time/gpu_hours` (components/compute_clock.py) this sets the control's training
loss and validation CE against the MHAR arm's at the same GPU-hours: the training loss as means over each quarter
of the control's GPU-hours, validation by interpolating the MHAR arm's CE between its two validations around the
control's GPU-hours (no CI: the batches are the same, the steps are not)."""

from __future__ import annotations

import bisect
import statistics
from typing import Any

from mhar_titan.components.compute_clock import TAG
from mhar_titan.components.tensorboard_scalars import PRIMARY_TAGS

Series = dict[int, float]


def interpolate(points: list[tuple[float, float]], x: float) -> float | None:
    """The piecewise-linear value at `x` through `points` (sorted by x); None outside them."""
    xs = [p[0] for p in points]
    if not points or x < xs[0] or x > xs[-1]:
        return None
    i = bisect.bisect_left(xs, x)
    if xs[i] == x:
        return points[i][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _hours(logged: Series) -> list[tuple[float, float]]:
    """(step, GPU-hours) from the log steps, with step 0 at 0 hours."""
    return sorted({0: 0.0, **logged}.items())


def hours_of(logged: Series, steps: list[int]) -> Series:
    """Each step's GPU-hours, interpolated between the log steps (steps beyond the last log step left out)."""
    points = _hours(logged)
    out = {}
    for s in steps:
        h = interpolate(points, s)
        if h is not None:
            out[s] = h
    return out


def summary(cs: dict[str, Series], ms: dict[str, Series]) -> dict[str, Any] | None:
    """Each arm's GPU-hours, the training loss by quarter of the control's GPU-hours, and each validation of the
    control against the MHAR arm's CE at the same GPU-hours; None where an arm logged no GPU-hours."""
    if TAG not in cs or TAG not in ms:
        return None
    c_loss, m_loss = cs["train/loss"], ms["train/loss"]
    hc, hm = hours_of(cs[TAG], sorted(c_loss)), hours_of(ms[TAG], sorted(m_loss))
    total = {"control": max(cs[TAG].values()), "mhar": max(ms[TAG].values())}
    total["ratio"] = total["mhar"] / total["control"] if total["control"] else None
    steps = sorted(hc)
    quarters = []
    for q in range(4):
        part = steps[q * len(steps) // 4 : (q + 1) * len(steps) // 4]
        if not part:
            continue
        lo, hi = hc[part[0]], hc[part[-1]]
        theirs = [s for s in sorted(hm) if lo <= hm[s] <= hi]
        if not theirs:
            continue
        c_mean = statistics.fmean(c_loss[s] for s in part)
        m_mean = statistics.fmean(m_loss[s] for s in theirs)
        quarters.append(
            {"hours": (lo, hi), "control_steps": (part[0], part[-1]), "mhar_steps": (theirs[0], theirs[-1]),
             "control": c_mean, "mhar": m_mean, "delta": m_mean - c_mean}
        )  # fmt: skip
    val = []
    for kind, tag in PRIMARY_TAGS.items():
        if tag not in cs or tag not in ms:
            continue
        m_points = sorted((h, ms[tag][s]) for s, h in hours_of(ms[TAG], sorted(ms[tag])).items())
        for s, h in sorted(hours_of(cs[TAG], sorted(cs[tag])).items()):
            theirs = interpolate(m_points, h)
            if theirs is not None:
                val.append({"kind": kind, "step": s, "hours": h, "control": cs[tag][s], "mhar": theirs,
                            "delta": theirs - cs[tag][s]})  # fmt: skip
    return {"hours": total, "quarters": quarters, "val": val}


def report_lines(s: dict[str, Any] | None, control: str, mhar: str) -> list[str]:
    if s is None:
        return ["## At equal compute", "", "An arm logged no GPU-hours (`time/gpu_hours`): not compared.", ""]
    h = s["hours"]
    ratio = f" ({mhar}/{control} {h['ratio']:.4f})" if h["ratio"] else ""
    lines = [
        "## At equal compute",
        "",
        f"GPU-hours of training steps (`time/gpu_hours`): {control} {h['control']:.4g}, {mhar} {h['mhar']:.4g}"
        f"{ratio}. The same comparisons as above, at the same GPU-hours instead of the same step:",
        "",
        f"| GPU-hours | {control} steps | {control} mean loss | {mhar} steps | {mhar} mean loss | Δ |",
        "|---|---|---:|---|---:|---:|",
    ]
    for q in s["quarters"]:
        lo, hi = q["hours"]
        lines.append(
            f"| {lo:.4g}-{hi:.4g} | {q['control_steps'][0]}-{q['control_steps'][1]} | {q['control']:.4f} | "
            f"{q['mhar_steps'][0]}-{q['mhar_steps'][1]} | {q['mhar']:.4f} | {q['delta']:+.3e} |"
        )
    if s["val"]:
        lines += ["", f"| weights | {control} step | GPU-hours | {control} val CE | {mhar} val CE there | Δ |"]
        lines.append("|---|---:|---:|---:|---:|---:|")
        lines += [
            f"| {v['kind']} | {v['step']} | {v['hours']:.4g} | {v['control']:.4f} | {v['mhar']:.4f} | "
            f"{v['delta']:+.3e} |"
            for v in s["val"]
        ]
        lines += ["", f"The {mhar} arm's CE there is interpolated between its validations around those GPU-hours."]
    return [*lines, ""]
