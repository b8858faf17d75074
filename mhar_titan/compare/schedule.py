"""The pair's schedule: the LR each arm applied, with the mixture stages' boundaries (`[data] mixture_stages`) drawn
on it and each stage's weights and realised shares, as logged (`data/stage`, `data/stage_share/<source>`) and as
recorded in the run's fingerprint.json: `schedule.png` and the report's "Schedule and mixture stages" section."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from mhar_titan.components import fingerprint

Series = dict[int, float]
LR_TAG, STAGE_TAG, SHARE_PREFIX = "lr/decay", "data/stage", "data/stage_share/"
PNG = "schedule.png"


def stage_starts(stage: Series) -> list[tuple[int, int]]:
    """[(stage number, the first logged step in it)] from the logged `data/stage` series."""
    out: list[tuple[int, int]] = []
    for step in sorted(stage):
        number = int(stage[step])
        if not out or out[-1][0] != number:
            out.append((number, step))
    return out


def recorded_weights(run: Path) -> dict[int, dict[str, float]]:
    """{stage number: normalised weights} from the run's fingerprint.json (stage 1: the mixture's), or {}."""
    recorded = fingerprint.read(str(run))
    data = (recorded or {}).get("data", {})
    mixture = data.get("mixture", {})
    out = {}
    if mixture:
        total = sum(m["weight"] for m in mixture.values())
        out[1] = {name: m["weight"] / total for name, m in mixture.items()}
    for stage in data.get("mixture_stages", []):
        out[stage["number"]] = stage["weights"]
    return out


def summary(cs: dict[str, Series], ms: dict[str, Series], c_run: Path) -> dict[str, Any] | None:
    """The stages with their first step, weights and each arm's share at the stage's last logged step; None
    without stages (no `data/stage` logged)."""
    if STAGE_TAG not in cs:
        return None
    starts = stage_starts(cs[STAGE_TAG])
    weights = recorded_weights(c_run)
    stages = []
    for i, (number, first) in enumerate(starts):
        end = starts[i + 1][1] if i + 1 < len(starts) else None
        shares = {}
        for arm, scalars in (("control", cs), ("mhar", ms)):
            at = [s for s in scalars.get(STAGE_TAG, {}) if s >= first and (end is None or s < end)]
            shares[arm] = {
                t.removeprefix(SHARE_PREFIX): v[max(at)]
                for t, v in scalars.items()
                if t.startswith(SHARE_PREFIX) and at and max(at) in v
            }
        stages.append({"number": number, "first_step": first, "weights": weights.get(number), "shares": shares})
    return {"stages": stages}


def plot(out: Path, cs: dict[str, Series], ms: dict[str, Series], stages: dict[str, Any] | None) -> Path | None:
    """schedule.png: each arm's LR by step, a dashed line where each stage begins; None without an LR series."""
    if LR_TAG not in cs:
        (out / PNG).unlink(missing_ok=True)
        return None
    fig = Figure(figsize=(8, 3.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for arm, scalars, style in (("control", cs, "-"), ("mhar", ms, "--")):
        lr = scalars.get(LR_TAG, {})
        ax.plot(sorted(lr), [lr[s] for s in sorted(lr)], style, lw=1.2, label=f"{arm}: {LR_TAG}")
    every = (stages or {}).get("stages", [])
    last = max((s for scalars in (cs, ms) for s in scalars.get(LR_TAG, {})), default=0)
    for i, stage in enumerate(every[1:], 1):
        end = every[i + 1]["first_step"] if i + 1 < len(every) else last
        ax.axvspan(stage["first_step"], end, color="C3", alpha=0.06 * (1 + i % 2))
        ax.axvline(stage["first_step"], color="C3", ls=":", lw=1)
        label = f"stage {stage['number']}"
        if stage["weights"]:
            label += ": " + ", ".join(f"{n} {w:.0%}" for n, w in stage["weights"].items())
        ax.annotate(
            label,
            (stage["first_step"], 0.98),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color="C3",
        )
    ax.set(xlabel="step", ylabel="learning rate", title="LR schedule and mixture stages")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / PNG, dpi=110)
    return out / PNG


def report_lines(stages: dict[str, Any] | None, drawn: bool) -> list[str]:
    """The report's section: the plot and, with stages, a table of them."""
    if not drawn:
        return []
    lines = ["## Schedule and mixture stages", "", f"![LR schedule and mixture stages]({PNG})", ""]
    if not stages:
        return [*lines, "One mixture stage: the mixture's own weights throughout (no `[data] mixture_stages`).", ""]
    lines += [
        "| stage | from step | weights | share in the stage, control | share in the stage, mhar |",
        "|---|---|---|---|---|",
    ]
    for st in stages["stages"]:
        weights = ", ".join(f"{n} {w:.1%}" for n, w in st["weights"].items()) if st["weights"] else "n/a"
        cells = [
            ", ".join(f"{n} {v:.1%}" for n, v in sorted(st["shares"][arm].items())) or "n/a"
            for arm in ("control", "mhar")
        ]
        lines.append(f"| {st['number']} | {st['first_step']} | {weights} | {cells[0]} | {cells[1]} |")
    return [*lines, "", "(Shares: of the tokens the stage had delivered at its last logged step, over all ranks.)", ""]
