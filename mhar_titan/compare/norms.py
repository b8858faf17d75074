"""The arms' per-layer norms side by side (`norms_<kind>/<group>`, components/param_norms.py): `norms.png` (each kind
by layer at the last step both logged), the relative differences in the delta run (`delta_norms_<kind>/<group>`),
and the report's "Per-layer norms" section naming where the arms differ most. A norm the control lacks (the MHAR
arm's routing groups) is shown for that arm alone."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from mhar_titan.components.tensorboard_scalars import NORM_KINDS as KINDS
from mhar_titan.components.tensorboard_scalars import NORM_TAG

Series = dict[int, float]
PNG = "norms.png"
TOP = 5  # the largest relative differences listed
NAMED = ("embedding", "final_norm", "output")
_LAYER = re.compile(r"^(layer|routing)(\d+)$")


def _norms(scalars: dict[str, Series]) -> dict[tuple[str, str], Series]:
    return {(m["kind"], m["group"]): values for tag, values in scalars.items() if (m := NORM_TAG.match(tag))}


def _relative(c: float, m: float) -> float:
    return (m - c) / c


def summary(cs: dict[str, Series], ms: dict[str, Series]) -> dict[str, Any] | None:
    """The last common step's norms of each group by kind, the largest relative differences (mhar - control) /
    control over every common step, and the MHAR arm's own groups; None where neither arm logged norms."""
    c, m = _norms(cs), _norms(ms)
    if not c and not m:
        return None
    both = sorted(set(c) & set(m))
    steps = sorted(set.intersection(*(set(c[k]) & set(m[k]) for k in both))) if both else []
    gaps = []
    for kind, group in both:
        cv, mv = c[(kind, group)], m[(kind, group)]
        for step in steps:
            if cv[step] > 0 and mv[step] != cv[step]:
                row = {"control": cv[step], "mhar": mv[step], "relative": _relative(cv[step], mv[step])}
                gaps.append({"kind": kind, "group": group, "step": step, **row})
    gaps.sort(key=lambda g: -abs(g["relative"]))
    last = steps[-1] if steps else None
    at_last: dict[str, dict[str, dict[str, float]]] = {kind: {} for kind in KINDS}
    for kind, group in both if last is not None else []:
        at_last[kind][group] = {"control": c[(kind, group)][last], "mhar": m[(kind, group)][last]}
    own = sorted({group for _, group in set(m) - set(c)})
    own_last = {kind: {g: m[(kind, g)][max(m[(kind, g)])] for g in own if (kind, g) in m} for kind in KINDS}
    return {
        "steps": steps,
        "last": last,
        "at_last": at_last,
        "largest": gaps[:TOP],
        "mhar_only": own,
        "mhar_only_last": own_last,
        "control_logged": bool(c),
        "mhar_logged": bool(m),
    }


def delta_series(cs: dict[str, Series], ms: dict[str, Series]) -> dict[str, Series]:
    """`delta_norms_<kind>/<group>`: (mhar - control) / control at each step both logged."""
    c, m = _norms(cs), _norms(ms)
    out = {}
    for kind, group in sorted(set(c) & set(m)):
        cv, mv = c[(kind, group)], m[(kind, group)]
        out[f"delta_norms_{kind}/{group}"] = {s: _relative(cv[s], mv[s]) for s in cv if s in mv and cv[s]}
    return out


def _by_layer(values: dict[str, dict[str, float]], prefix: str) -> list[tuple[int, dict[str, float]]]:
    return sorted((int(mt[2]), v) for g, v in values.items() if (mt := _LAYER.match(g)) and mt[1] == prefix)


def plot(out: Path, s: dict[str, Any] | None, control: str, mhar: str) -> Path | None:
    """norms.png: a panel a kind, each arm's norm of every layer at the last common step (the MHAR arm's routing
    groups dotted); None (and a stale file removed) without a common step."""
    path = out / PNG
    path.unlink(missing_ok=True)
    if not s or s["last"] is None:
        return None
    fig = Figure(figsize=(8, 8))
    FigureCanvasAgg(fig)
    for i, kind in enumerate(KINDS):
        ax = fig.add_subplot(len(KINDS), 1, i + 1)
        layers = _by_layer(s["at_last"][kind], "layer")
        drawn = []
        for arm, name, style in (("control", control, "o-"), ("mhar", mhar, "s--")):
            ax.plot([n for n, _ in layers], [v[arm] for _, v in layers], style, label=name, markersize=3)
            drawn += [v[arm] for _, v in layers]
        routing = sorted((int(mt[2]), v) for g, v in s["mhar_only_last"][kind].items() if (mt := _LAYER.match(g)))
        if routing:
            ax.plot([n for n, _ in routing], [v for _, v in routing], ":", label=f"{mhar} routing")
            drawn += [v for _, v in routing]
        if drawn and min(drawn) > 0:  # a zero (the update at the warmup's first step) has no place on a log axis
            ax.set_yscale("log")
        ax.set_ylabel(f"{kind} norm")
        ax.legend(fontsize=7)
    ax.set_xlabel(f"layer (step {s['last']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def report_lines(s: dict[str, Any] | None, control: str, mhar: str) -> list[str]:
    """The report's section; nothing where neither arm logged norms."""
    if not s:
        return []
    lines = ["## Per-layer norms", ""]
    missing = [name for name, logged in ((control, s["control_logged"]), (mhar, s["mhar_logged"])) if not logged]
    if missing or s["last"] is None:
        who = " and ".join(missing) or "the arms at one step"
        return [*lines, f"No common step: {who} logged no norms (`[norms] freq`).", ""]
    lines += [
        f"Weight, gradient and update norms by group, logged by both arms at {len(s['steps'])} steps "
        f"(`norms_<kind>/<group>`; relative differences in the delta run as `delta_norms_<kind>/<group>`).",
        "",
        f"At step {s['last']}:",
        "",
        "| group | " + " | ".join(f"{kind} {arm}" for kind in KINDS for arm in (control, mhar)) + " |",
        "|---|---|---|---|---|---|---|",
    ]
    for group in NAMED:
        if group in s["at_last"]["weight"]:
            row = [f"{s['at_last'][k][group][arm]:.4g}" for k in KINDS for arm in ("control", "mhar")]
            lines.append(f"| {group} | {' | '.join(row)} |")
    if not s["largest"]:
        return [*lines, "", "The arms' norms are equal at every common step.", "", f"![per-layer norms]({PNG})", ""]
    lines += ["", "Where the arms differ most, (mhar - control) / control over every common step:", ""]
    lines += ["| kind | group | step | control | mhar | relative |", "|---|---|---|---|---|---|"]
    lines += [
        f"| {g['kind']} | {g['group']} | {g['step']} | {g['control']:.4g} | {g['mhar']:.4g} | {g['relative']:+.2%} |"
        for g in s["largest"]
    ]
    if s["mhar_only"]:
        lines += ["", f"{mhar} alone: the routing groups (`routingNN`, {len(s['mhar_only'])}), drawn dotted."]
    return [*lines, "", f"![per-layer norms]({PNG})", ""]
