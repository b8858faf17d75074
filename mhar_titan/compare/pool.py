"""Several pairs (seeds) pooled: each pair's validation delta at the last step every pair evaluated, their mean and a
95% t-interval over the pairs. Within a pair the CI covers the held-out batches; across pairs it covers what a
seed moves (the data order, the initial state of the run), which one pair cannot show.

    python -m mhar_titan.compare runs/pair-s0 runs/pair-s1 runs/pair-s2 [--out DIR]
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from mhar_titan.compare.stats import paired_ci

POOL_MD = "pool.md"


def pooled(results: list[dict[str, Any]]) -> dict[str, Any]:
    """From each pair's comparison (pair.compare's result): the deltas at the last step all pairs evaluated."""
    steps = set.intersection(*({row["step"] for row in r["val"]} for r in results)) if results else set()
    out: dict[str, Any] = {"pairs": [r["pair"] for r in results], "step": max(steps) if steps else None}
    for weights in ("raw", "ema"):
        deltas = []
        for r in results:
            row = next((row for row in r["val"] if row["step"] == out["step"]), None)
            if row is not None and row.get(weights):
                deltas.append(row[weights]["delta"])
        full = len(deltas) == len(results)
        ci = paired_ci(deltas) if full else None
        out[weights] = {"deltas": deltas if full else [], "mean": statistics.fmean(deltas) if full else None, "ci": ci}
    return out


def write(out: Path, p: dict[str, Any]) -> Path:
    """pool.md in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# {len(p['pairs'])} pairs pooled", ""]
    if p["step"] is None:
        lines.append("The pairs have no evaluation step in common: nothing pooled.")
    else:
        lines += [f"Validation CE, mhar - control, at step {p['step']} (the last step every pair evaluated):", ""]
        lines += ["| pair | raw | ema |", "|---|---:|---:|"]
        for i, pair in enumerate(p["pairs"]):
            cells = [f"{p[w]['deltas'][i]:+.3e}" if p[w]["deltas"] else "n/a" for w in ("raw", "ema")]
            lines.append(f"| {pair} | {' | '.join(cells)} |")
        for w in ("raw", "ema"):
            ci = p[w]["ci"]
            if ci is not None:
                side = "within the pairs' spread"
                side = "MHAR lower" if ci["high"] < 0 else "MHAR higher" if ci["low"] > 0 else side
                lines.append(
                    f"\n**{w}: mean {ci['mean']:+.3e}, 95% CI over {ci['n']} pairs [{ci['low']:+.3e}, "
                    f"{ci['high']:+.3e}]: {side}.**"
                )
            elif p[w]["mean"] is not None:
                lines.append(f"\n{w}: mean {p[w]['mean']:+.3e} (one pair: no CI over pairs)")
    path = out / POOL_MD
    path.write_text("\n".join(lines) + "\n")
    return path
