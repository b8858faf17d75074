"""Statistics of a pair, apart from any writing: Student-t quantiles and paired confidence intervals, the
batch-to-batch noise of a loss curve, where two arms' series first differ, and a median past warm-up."""

from __future__ import annotations

import math
import statistics
from typing import Any

Series = dict[int, float]
WARMUP_LOGS = 5  # tokens/s log points left out of the median (compilation, caches)


def _t_central(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with integer df (Abramowitz & Stegun 26.7.3/26.7.4, a finite sum)."""
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df == 1:
        return 2 * theta / math.pi
    term = total = 1.0
    if df % 2:
        for k in range(1, (df - 1) // 2):
            term *= 2 * k / (2 * k + 1) * c2
            total += term
        return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
    for k in range(1, df // 2):
        term *= (2 * k - 1) / (2 * k) * c2
        total += term
    return math.sin(theta) * total


def t_quantile(p: float, df: int) -> float:
    """Student-t quantile for 0.5 <= p < 1 and integer df >= 1; the project has no scipy."""
    if not 0.5 <= p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and df >= 1, got p={p}, df={df}")
    target, lo, hi = 2 * p - 1, 0.0, 1.0
    while _t_central(hi, df) < target:
        lo, hi = hi, 2 * hi
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_central(mid, df) < target else (lo, mid)
        if hi - lo <= 1e-15 * hi:
            break
    return (lo + hi) / 2


def paired_ci(diffs: list[float], level: float = 0.95) -> dict[str, float] | None:
    """Mean of paired differences ± t_{(1+level)/2, n-1}·sd/√n; None with fewer than 2 pairs."""
    n = len(diffs)
    if n < 2:
        return None
    mean = statistics.fmean(diffs)
    half = t_quantile(0.5 + level / 2, n - 1) * statistics.stdev(diffs) / math.sqrt(n)
    return {"n": n, "mean": mean, "half_width": half, "low": mean - half, "high": mean + half}


def batch_noise(losses: list[float]) -> float | None:
    """Per-step noise of a loss series around its trend: sd of successive differences / √2.

    Differencing removes a slowly varying trend; independent noise of sd σ gives differences of variance 2σ².
    """
    if len(losses) < 3:
        return None
    return statistics.stdev(b - a for a, b in zip(losses, losses[1:], strict=False)) / math.sqrt(2)


def divergence(c: Series | None, m: Series | None, steps: list[int]) -> dict[str, Any]:
    """Identical on the aligned steps, or the first step where the values differ or one is missing."""
    if c is None and m is None:
        return {"identical": None}
    for s in steps:
        a, b = (c or {}).get(s), (m or {}).get(s)
        if a != b:
            return {"identical": False, "step": s, "control": a, "mhar": b}
    return {"identical": True}


def median_after_warmup(series: Series | None) -> float | None:
    if not series:
        return None
    values = list(series.values())
    return statistics.median(values[WARMUP_LOGS:] or values)
