"""The watcher's report: per task and metric, the base (step 0), then each arm at every evaluated step with the
paired MHAR - control delta and its 95% CI over the same documents (eval/pair.py's paired_rows), as a table
and a plot, from the records of the store alone (store.py), so a restarted watcher redraws the same report.

It goes where the one-step evaluation's goes: `<pair>/compare/eval.md` and `eval.json`, the "Evaluation"
section of `report.md` (kept by `python -m mhar_titan.compare` when it is redone), TensorBoard scalars in
`<pair>/eval` at each step (the base at step 0 for both arms), and `<pair>/compare/eval_over_steps.png`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from data.atomic import write_text
from mhar_titan.eval.pair import REPORT_END, REPORT_START, fmt, paired_rows, write_scalars, write_section
from mhar_titan.eval.steps import ARMS
from mhar_titan.eval.store import Key, Store

PLOT = "eval_over_steps.png"
PLOT_COLUMNS = 4
STYLE = {"raw": "-", "ema": "--"}
COLOUR = {"control": "C0", "mhar": "C1"}
LABEL = {"raw": "raw", "ema": "EMA"}


def merged(records: dict[Key, dict], arm: str, step: int, weights: str, tasks: list[str]) -> dict[str, Any] | None:
    """One model's scores on every task (what paired_rows reads), or None while a task's record is missing."""
    found = [records.get(Key(arm, step, weights, task)) for task in tasks]
    if any(r is None for r in found):
        return None
    out: dict[str, Any] = {"results": {}, "samples": {}, "group_subtasks": {}}
    for record in found:
        for part in out:
            out[part].update(record["scores"].get(part) or {})
    return out


def progress(records: dict[Key, dict], settings: dict[str, Any], skipped: dict[int, str]) -> dict[str, Any]:
    """The report's content: the base's scores, and per weights and step (where both arms have every task) the
    paired rows of the requested tasks (a group's members stay in the records), each with the base's value."""
    tasks = settings["tasks"]
    base = merged(records, "base", 0, "raw", tasks)
    steps = sorted({k.step for k in records if k.arm in ARMS})
    results: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for weights in settings["weights"]:
        results[weights] = {}
        for step in steps:
            control, mhar = (merged(records, arm, step, weights, tasks) for arm in ARMS)
            if control is None or mhar is None:
                continue
            rows = [r for r in paired_rows(control, mhar) if r["task"] in tasks]
            for r in rows:
                values = (base or {}).get("results", {}).get(r["task"], {})
                r["base"] = _number(values.get(r["metric"]))
                r["base_stderr"] = _number(values.get(r["metric"].replace(",", "_stderr,", 1)))
            results[weights][step] = rows
    evaluated = sorted(set().union(*(set(by_step) for by_step in results.values())))
    return {
        "tasks": tasks,
        "settings": settings,
        "base": base_rows(base, tasks),
        "steps": evaluated,
        "skipped": {int(s): why for s, why in sorted(skipped.items())},
        "results": results,
    }


def base_rows(base: dict[str, Any] | None, tasks: list[str]) -> list[dict[str, Any]]:
    """The base's metrics of the requested tasks, as rows with both arms at the base (step 0: they start there)."""
    rows = []
    for task in tasks:
        for key, value in sorted(((base or {}).get("results", {}).get(task) or {}).items()):
            if "," in key and "_stderr" not in key and isinstance(value, (int, float)):
                rows.append({"task": task, "metric": key, "control": float(value), "mhar": float(value), "delta": 0.0})
    return rows


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _ci(r: dict[str, Any]) -> str:
    return f"[{r['delta_ci'][0]:+.4f}, {r['delta_ci'][1]:+.4f}]" if r.get("delta_ci") else "-"


def markdown(report: dict[str, Any], base_note: str, plot: Path | None) -> str:
    """The report's Evaluation section: the settings, the latest step as the paper's Table 3 (base / control /
    MHAR), then each task's metric over the steps for both arms with the paired CIs."""
    s = report["settings"]
    shots = ", ".join(f"{t} {'default' if n is None else n}" for t, n in s["num_fewshot"].items())
    which = " and ".join(LABEL.get(w, w) for w in s["weights"])
    lines = [
        REPORT_START,
        "## Evaluation (lm-evaluation-harness)",
        "",
        f"Every kept checkpoint that both arms have, {which} weights, evaluated as it landed "
        f"(`python -m mhar_titan.eval --watch`/`--once`) with the same settings: tasks {', '.join(s['tasks'])}"
        f"{' (suite ' + s['suite'] + ')' if s.get('suite') else ''}; shots: {shots}; "
        f"{s['limit'] or 'all'} documents per task; {s['dtype']} on {s['device']}, batch size {s['batch_size']}; "
        f"lm-eval {s['lm_eval']}. The base column is {base_note}. delta = MHAR - control with a paired stderr "
        "and 95% CI over the same documents.",
        "",
    ]
    if report["skipped"]:
        lines += [f"Not evaluated: {skipped_text(report['skipped'])}.", ""]
    if not report["steps"]:
        return "\n".join([*lines, "No step of both arms evaluated yet.", "", REPORT_END, ""])
    latest = report["steps"][-1]
    lines += [f"### Step {latest} (the latest evaluated): base / control / MHAR", ""]
    for weights, by_step in report["results"].items():
        if latest not in by_step:
            continue
        lines += [
            f"**{LABEL.get(weights, weights)} weights**",
            "",
            "| task | metric | base | control | mhar | delta | stderr | 95% CI | n |",
        ]
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for r in by_step[latest]:
            lines.append(
                f"| {r['task']} | {r['metric'].removesuffix(',none')} | {fmt(r['base'])} | {fmt(r['control'])} ± "
                f"{fmt(r['control_stderr'])} | {fmt(r['mhar'])} ± {fmt(r['mhar_stderr'])} | {r['delta']:+.4f} | "
                f"{fmt(r['delta_stderr'])} | {_ci(r)} | {r['n']} |"
            )
        lines.append("")
    lines += ["### Over steps", ""] + ([f"![metric over steps]({plot.name})", ""] if plot else [])
    return "\n".join([*lines, *over_steps(report), REPORT_END, ""])


def skipped_text(skipped: dict[int, str]) -> str:
    """The skipped steps, those with the same reason together: "steps 500, 1000: why; step 1250: why"."""
    by_reason: dict[str, list[int]] = {}
    for step, why in sorted(skipped.items()):
        by_reason.setdefault(why, []).append(step)
    return "; ".join(f"step{'s' if len(s) > 1 else ''} {', '.join(map(str, s))}: {why}" for why, s in by_reason.items())


def over_steps(report: dict[str, Any]) -> list[str]:
    """A table per task and metric: a row per step (the base first), each weights' control, MHAR, delta and CI."""
    every = list(report["results"])
    lines = []
    for task, metric in _metrics(report, None):
        head = " | ".join(f"control ({w}) | mhar ({w}) | delta ({w}) | 95% CI ({w})" for w in every)
        lines += [
            f"**{task} {metric.removesuffix(',none')}**",
            "",
            f"| step | {head} |",
            "|---" * (1 + 4 * len(every)) + "|",
        ]
        base = next((r["control"] for r in report["base"] if (r["task"], r["metric"]) == (task, metric)), None)
        if base is not None:
            lines.append("| 0 (base) | " + " | ".join(f"{base:.4f} | {base:.4f} | - | -" for _ in every) + " |")
        for step in report["steps"]:
            cells = []
            for w in every:
                r = _row(report, w, step, task, metric)
                cells.append(
                    f"{fmt(r['control'])} | {fmt(r['mhar'])} | {r['delta']:+.4f} | {_ci(r)}" if r else "- | - | - | -"
                )
            lines.append(f"| {step} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _row(report: dict[str, Any], weights: str, step: int, task: str, metric: str) -> dict[str, Any] | None:
    rows = report["results"].get(weights, {}).get(step, [])
    return next((r for r in rows if (r["task"], r["metric"]) == (task, metric)), None)


def _metrics(report: dict[str, Any], only: dict[str, str] | None) -> list[tuple[str, str]]:
    """(task, metric) pairs in the order of the tasks; with `only` (a suite's), the one metric per task."""
    found = {(r["task"], r["metric"]) for rows in report["results"].values() for rs in rows.values() for r in rs}
    found |= {(r["task"], r["metric"]) for r in report["base"]}
    order = {t: i for i, t in enumerate(report["tasks"])}
    pairs = sorted(found, key=lambda tm: (order.get(tm[0], len(order)), tm[1]))
    return [(t, m) for t, m in pairs if not only or only.get(t) == m]


def plot(report: dict[str, Any], path: Path) -> Path | None:
    """Per task and metric, each arm's score over the steps from the base at step 0 (raw solid, EMA dashed), and
    below it the paired delta with its 95% CI."""
    pairs = _metrics(report, report["settings"].get("metrics"))
    if not pairs or not report["steps"]:
        return None
    cols = min(PLOT_COLUMNS, len(pairs))
    blocks = math.ceil(len(pairs) / cols)
    fig = Figure(figsize=(4.2 * cols, 5.6 * blocks))
    FigureCanvasAgg(fig)  # the Agg canvas: a PNG file, no display and no pyplot state
    axes = fig.subplots(2 * blocks, cols, squeeze=False)
    for i, (task, metric) in enumerate(pairs):
        top, bottom = axes[2 * (i // cols)][i % cols], axes[2 * (i // cols) + 1][i % cols]
        _draw(report, task, metric, top, bottom)
    for j in range(len(pairs), blocks * cols):
        axes[2 * (j // cols)][j % cols].axis("off")
        axes[2 * (j // cols) + 1][j % cols].axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _draw(report: dict[str, Any], task: str, metric: str, top: Any, bottom: Any) -> None:
    base = next((r["control"] for r in report["base"] if (r["task"], r["metric"]) == (task, metric)), None)
    for k, weights in enumerate(report["results"]):
        rows = [(s, _row(report, weights, s, task, metric)) for s in report["steps"]]
        rows = [(s, r) for s, r in rows if r]
        steps = [s for s, _ in rows]
        for arm in ARMS:
            xs, ys = (
                ([0] if base is not None else []) + steps,
                ([base] if base is not None else []) + [r[arm] for _, r in rows],
            )
            top.plot(xs, ys, STYLE.get(weights, ":"), color=COLOUR[arm], marker="o", ms=3, label=f"{arm} ({weights})")
        ci = [r["delta_ci"] or [r["delta"], r["delta"]] for _, r in rows]
        errors = [
            [r["delta"] - c[0] for (_, r), c in zip(rows, ci, strict=True)],
            [c[1] - r["delta"] for (_, r), c in zip(rows, ci, strict=True)],
        ]
        shift = (k - 0.5) * 0.01 * max(steps or [1])
        style = dict(fmt="o" + STYLE.get(weights, ":"), color="C2" if weights == "raw" else "C3", capsize=3, ms=3)
        bottom.errorbar([s + shift for s in steps], [r["delta"] for _, r in rows], yerr=errors, label=weights, **style)
    if base is not None:
        top.plot([0], [base], "k*", ms=9, label="base")
    top.set_title(f"{task} {metric.removesuffix(',none')}", fontsize=9)
    top.set_xlabel("step")
    top.legend(fontsize=6)
    bottom.set_xlim(top.get_xlim())  # the steps line up with the scores above
    bottom.axhline(0.0, color="gray", lw=0.8)
    bottom.set_title("MHAR - control, 95% CI", fontsize=9)
    bottom.set_xlabel("step")
    bottom.legend(fontsize=6)


def write_report(pair: Path, out: Path, store: Store, skipped: dict[int, str], base_note: str) -> dict[str, Any]:
    """eval.json, eval.md, the report's section and the plot, redrawn from the store; TensorBoard scalars for
    the steps not yet written there (the store remembers which)."""
    report = progress(store.records, store.settings or {}, skipped)
    out.mkdir(parents=True, exist_ok=True)
    figure = plot(report, out / PLOT)
    write_text(out / "eval.json", json.dumps(report, indent=1) + "\n")
    write_section(out, markdown(report, base_note, figure))
    logged = store.logged()
    new: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for weights, by_step in report["results"].items():
        for step, rows in by_step.items():
            if (weights, step) not in logged:
                new.setdefault(step, {})[weights] = rows
        if report["base"] and (weights, 0) not in logged:
            new.setdefault(0, {})[weights] = report["base"]
    if new:
        write_scalars(pair / "eval", new)
        store.mark_logged(logged | {(w, s) for s, by_weights in new.items() for w in by_weights})
    return report
