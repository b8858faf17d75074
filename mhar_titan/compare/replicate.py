"""How sure: MHAR's delta against an A/A difference. `launch/pair.sh --replicate SEED|same` runs the control a second
time (`<pair>/replicate`), with another data-order seed (what the data order alone moves) or its own (what GPU
nondeterminism alone moves); this sets replicate - control beside mhar - control at every evaluation, over the
same held-out batches, and says whether MHAR's delta exceeds the A/A difference: mhar - replicate (the two arms
measured against the second control) must exclude 0 on the side of MHAR's delta, and be larger than the A/A
difference. Training loss the same way, by quarter of the steps (their batches differ between data seeds, so
step by step they are noise)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from mhar_titan.compare.validation import VAL_TAGS, val_delta
from mhar_titan.components import fingerprint
from mhar_titan.components.tensorboard_scalars import LOSS_TAG

Series = dict[int, float]
ARM = "replicate"


def _seed(run: Path) -> int | None:
    recorded = fingerprint.read(str(run)) or {}
    seed = recorded.get("data", {}).get("seed")
    return int(seed) if seed is not None else None


def _exceeds(mhar: dict | None, aa: dict | None, beyond: dict | None) -> bool | None:
    """Whether MHAR's delta exceeds the A/A difference; None where a CI is missing."""
    if not mhar or not aa or not beyond or beyond.get("ci") is None:
        return None
    ci, d = beyond["ci"], mhar["delta"]
    resolved = ci["high"] < 0 if d < 0 else ci["low"] > 0
    return bool(resolved and abs(d) > abs(aa["delta"]))


def summary(
    c_run: Path, r_run: Path, cs: dict[str, Series], ms: dict[str, Series], rs: dict[str, Series],
    cv: dict[int, dict], mv: dict[int, dict], rv: dict[int, dict],
) -> dict[str, Any]:  # fmt: skip
    """The A/A difference and MHAR's delta at every evaluation all three ran, and by quarter of the training
    steps all three logged."""
    c_seed, r_seed = _seed(c_run), _seed(r_run)
    kind = "same seed" if c_seed is not None and c_seed == r_seed else "another seed"
    rows = []
    for step in sorted(set(cv) & set(mv) & set(rv)):
        if step == 0:
            continue
        row: dict[str, Any] = {"step": step}
        for weights in VAL_TAGS:
            c, m, r = (v[step].get(weights) for v in (cv, mv, rv))
            aa, delta, beyond = val_delta(c, r, None, None), val_delta(c, m, None, None), val_delta(r, m, None, None)
            row[weights] = {"aa": aa, "mhar": delta, "beyond": beyond, "exceeds": _exceeds(delta, aa, beyond)}
        rows.append(row)
    c_loss, m_loss, r_loss = cs[LOSS_TAG], ms[LOSS_TAG], rs.get(LOSS_TAG, {})
    steps = sorted(set(c_loss) & set(m_loss) & set(r_loss))
    quarters = []
    for q in range(4):
        part = steps[q * len(steps) // 4 : (q + 1) * len(steps) // 4]
        if part:
            aa = statistics.fmean(r_loss[s] - c_loss[s] for s in part)
            mhar = statistics.fmean(m_loss[s] - c_loss[s] for s in part)
            quarters.append({"first": part[0], "last": part[-1], "aa": aa, "mhar": mhar})
    return {"seeds": {"control": c_seed, ARM: r_seed}, "kind": kind, "val": rows, "quarters": quarters}


def delta_series(rs: dict[str, Series], cs: dict[str, Series]) -> dict[str, Series]:
    """`aa/train_loss` (replicate - control) at every step both logged, for the delta run."""
    c, r = cs[LOSS_TAG], rs.get(LOSS_TAG, {})
    return {"aa/train_loss": {s: r[s] - c[s] for s in sorted(set(c) & set(r))}}


def _d(p: dict | None) -> str:
    if not p:
        return "n/a"
    ci = p.get("ci")
    return f"{p['delta']:+.3e}" + (f" [{ci['low']:+.3e}, {ci['high']:+.3e}]" if ci else "")


def report_lines(s: dict[str, Any] | None, control: str, mhar: str) -> list[str]:
    if s is None:
        return []
    seeds = s["seeds"]
    lines = [
        "## How sure: the A/A difference",
        "",
        f"`{ARM}` is the control run again with the {s['kind']} (data seed {seeds[ARM]}, the control's "
        f"{seeds['control']}): what {'GPU nondeterminism' if s['kind'] == 'same seed' else 'the data order'} alone "
        f"moves. MHAR's delta exceeds it where {mhar} - {ARM} excludes 0 on the side of the delta (95% CI over the "
        "same batches) and is larger than the A/A difference.",
        "",
        f"| step | weights | A/A ({ARM} - {control}) | {mhar} - {control} | {mhar} - {ARM} | exceeds |",
        "|---:|---|---|---|---|---|",
    ]
    for row in s["val"]:
        for weights in VAL_TAGS:
            p = row[weights]
            said = {True: "yes", False: "no", None: "n/a"}[p["exceeds"]]
            lines.append(
                f"| {row['step']} | {weights} | {_d(p['aa'])} | {_d(p['mhar'])} | {_d(p['beyond'])} | {said} |"
            )
    if s["val"]:
        last = s["val"][-1]["raw"]
        verdict = {
            True: "exceeds the A/A difference",
            False: "does not exceed the A/A difference",
            None: "cannot be set against the A/A difference (no per-batch records)",
        }[last["exceeds"]]
        lines += ["", f"**At step {s['val'][-1]['step']}, MHAR's validation delta {verdict}.**"]
    if s["quarters"]:
        lines += ["", f"| training steps | mean A/A Δloss | mean {mhar} Δloss |", "|---|---:|---:|"]
        lines += [f"| {q['first']}-{q['last']} | {q['aa']:+.3e} | {q['mhar']:+.3e} |" for q in s["quarters"]]
    return [*lines, ""]
