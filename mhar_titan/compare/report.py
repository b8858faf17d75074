"""The written side of the paired comparison: the plots, report.md and the summary printed by the command line,
from the figures mhar_titan/compare/pair.py computed."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from mhar_titan.compare import bands, compute, norms, replicate, routing, schedule
from mhar_titan.compare import validation as cval
from mhar_titan.compare.stats import WARMUP_LOGS
from mhar_titan.components.endings import RESTARTED
from mhar_titan.components.tensorboard_scalars import LOSS_TAG

CHECKED = ("lr/decay", "tokens_seen")
Series = dict[int, float]


def _save(fig: Figure, out: Path, name: str) -> Path:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    return out / name


def _new_figure(height: float) -> Figure:
    fig = Figure(figsize=(8, height))
    FigureCanvasAgg(fig)
    return fig


def plots(
    out: Path,
    steps: list[int],
    c_loss: Series,
    m_loss: Series,
    deltas: list[float],
    noise: float | None,
    val: list[dict],
    control: str,
    mhar: str,
) -> list[Path]:
    """The comparison's PNGs in `out`: both loss curves, the paired loss delta, and the validation deltas
    when there are any (a stale val_delta.png is removed)."""
    paths = [
        _train_loss_plot(out, steps, c_loss, m_loss, control, mhar),
        _delta_plot(out, steps, deltas, noise, control, mhar),
    ]
    stale = out / "val_delta.png"
    stale.unlink(missing_ok=True)
    if any(r["raw"] or r["ema"] for r in val):
        paths.append(_val_delta_plot(out, val, control, mhar))
    return paths


def _train_loss_plot(out: Path, steps: list[int], c_loss: Series, m_loss: Series, control: str, mhar: str) -> Path:
    fig = _new_figure(4.5)
    ax = fig.add_subplot()
    ax.plot(steps, [c_loss[s] for s in steps], lw=0.8, label=control)
    ax.plot(steps, [m_loss[s] for s in steps], lw=0.8, label=mhar, alpha=0.8)
    ax.set(xlabel="step", ylabel=LOSS_TAG, title="training loss")
    ax.legend()
    return _save(fig, out, "train_loss.png")


def _delta_plot(out: Path, steps: list[int], deltas: list[float], noise: float | None, control: str, mhar: str) -> Path:
    """Δ and |Δ| (log scale) of the training loss against the control's batch noise."""
    fig = _new_figure(6.5)
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.plot(steps, deltas, lw=0.8, color="C3", label=f"Δ = {mhar} − {control}")
    abs_d = [abs(d) for d in deltas]
    bottom.plot(steps, abs_d, lw=0.8, color="C3", label="|Δ|")
    if noise:
        top.fill_between(steps, -noise, noise, color="0.85", label=f"± control batch noise ({noise:.2e})")
        bottom.axhline(noise, color="0.4", ls="--", label="control batch noise")
    if any(abs_d):
        bottom.set_yscale("log")
    top.axhline(0, color="k", lw=0.5)
    top.set(ylabel="Δ train loss", title="paired training-loss difference")
    bottom.set(xlabel="step", ylabel="|Δ train loss|")
    top.legend(loc="upper right")
    bottom.legend(loc="lower right")
    return _save(fig, out, "delta_train_loss.png")


def _val_delta_plot(out: Path, val: list[dict], control: str, mhar: str) -> Path:
    """Validation deltas per weight set, raw and EMA shifted apart so their CI bars do not overlap."""
    fig = _new_figure(4.5)
    ax = fig.add_subplot()
    span = (val[-1]["step"] - val[0]["step"]) or 1
    for i, (kind, label) in enumerate((("raw", "raw weights"), ("ema", "EMA weights"))):
        shift = (i - 0.5) * 0.01 * span
        ci = [(r["step"] + shift, r[kind]["ci"]) for r in val if r[kind] and r[kind]["ci"]]
        if ci:
            ax.errorbar(
                [x for x, _ in ci],
                [c["mean"] for _, c in ci],
                yerr=[c["half_width"] for _, c in ci],
                fmt="o",
                color=f"C{i}",
                capsize=3,
                label=f"{label}: mean per-batch Δ, 95% CI",
            )
        agg = [(r["step"] + shift, r[kind]["delta"]) for r in val if r[kind]]
        ax.plot([x for x, _ in agg], [d for _, d in agg], "x", color=f"C{i}", label=f"{label}: Δ val CE")
    ax.axhline(0, color="k", lw=0.5)
    ax.set(xlabel="step", ylabel="Δ val CE", title=f"validation: {mhar} − {control}")
    ax.legend()
    return _save(fig, out, "val_delta.png")


def _f(x: float | None, fmt: str = ".3e") -> str:
    return "n/a" if x is None else format(x, fmt)


def _steps_text(steps: list[int]) -> str:
    if not steps:
        return "none"
    if len(steps) <= 8:
        return ", ".join(map(str, steps))
    return f"{len(steps)} steps between {steps[0]} and {steps[-1]}"


def _check_text(check: dict[str, Any], control: str, mhar: str, n: int) -> str:
    if check["identical"] is None:
        return "n/a (absent in both arms)"
    if check["identical"]:
        return f"identical over the {n} aligned steps"
    where = f"`{check['tag']}` " if "tag" in check else ""
    c, m = ("missing" if v is None else v for v in (check["control"], check["mhar"]))
    return f"**diverges** ({where}first at step {check['step']}: {control} {c}, {mhar} {m})"


def report_text(r: dict[str, Any], control: str, mhar: str) -> str:
    """report.md: the alignment, the training-loss deltas against the noise, validation, routing,
    throughput and the consistency checks."""
    lines = _intro_lines(r, control, mhar)
    lines += _training_loss_lines(r, control, mhar)
    lines += cval.report_lines(r, control, mhar)
    lines += replicate.report_lines(r.get("replicate"), control, mhar)
    if "equal_compute" in r:
        lines += compute.report_lines(r["equal_compute"], control, mhar)
    lines += cval.named_set_lines(r.get("validation_sets", []), control, mhar)
    lines += bands.report_lines(r.get("bands"), control, mhar)
    lines += routing.report_lines(r.get("routing"), mhar, r["delta_dir"])
    lines += schedule.report_lines(r.get("stages"), r.get("schedule_drawn", False))
    lines += norms.report_lines(r.get("norms"), control, mhar)
    lines += _spike_lines(r.get("spikes"), control, mhar)
    lines += ending_lines(r.get("endings"), control, mhar)
    lines += _throughput_lines(r["tokens_per_s"], control, mhar)
    lines += _consistency_lines(r, control, mhar)
    return "\n".join(lines)


def _intro_lines(r: dict[str, Any], control: str, mhar: str) -> list[str]:
    """Title, what Δ is and which steps were aligned, and the base warning when the arms' step 0 differs."""
    steps = r["steps"]
    lines = [
        f"# Paired comparison: {r['pair']}",
        "",
        f"Δ = `{mhar}` − `{control}` ({r['arms']['mhar']} − {r['arms']['control']}), aligned on the "
        f"{len(steps)} steps both arms logged ({steps[0]}..{steps[-1]}).",
        f"Steps in `{control}` only: {_steps_text(r['only_control'])}. "
        f"Steps in `{mhar}` only: {_steps_text(r['only_mhar'])}.",
        f"The deltas are the TensorBoard run `{r['delta_dir']}`: `tensorboard --logdir {r['pair']}` overlays "
        "control, mhar and delta.",
        "",
    ]
    warning = cval.base_warning(r["base"], control, mhar)
    lines += [warning, ""] if warning else []
    history = r["checks"].get("history", {})
    if history.get("identical") is False:
        lines += [
            "**WARNING: the arms' histories differ, so they are not a matched pair from there on:** "
            + "; ".join(history["differences"])
            + ". Apply a change to both arms at one step (`launch/pair.sh --load-step N` with the change).",
            "",
        ]
    return lines


def _training_loss_lines(r: dict[str, Any], control: str, mhar: str) -> list[str]:
    """The training-loss section: the noise, the float32 resolution, the first steps and the quarters."""
    steps, noise = r["steps"], r["noise"]
    first_loss = r["head"][0]["control"]
    ulp = 2.0 ** (math.frexp(first_loss)[1] - 24) if first_loss else None
    lines = [
        "## Training loss",
        "",
        f"Batch-to-batch noise of the control: **{_f(noise)}**, the sd of its successive loss differences / √2 over "
        "the aligned steps (differencing removes the slow trend and doubles the variance of independent noise).",
        f"Losses are float32 in TensorBoard: one ulp at the step-{steps[0]} loss is {_f(ulp, '.1e')}.",
        "",
        f"Step {r['first_step']}: |Δ| = **{_f(r['first_step_abs_delta'])}**, "
        f"{_f(r['ratio_first'], '.3g')} × the noise.",
        "",
        "### Start",
        "",
        f"| step | {control} | {mhar} | Δ | \\|Δ\\| / noise |",
        "|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {h['step']} | {h['control']:.6f} | {h['mhar']:.6f} | {h['delta']:+.3e} | {_f(h['ratio'], '.3g')} |"
        for h in r["head"]
    ]
    lines += [
        "",
        "### Over training (quarters of the aligned steps)",
        "",
        "| steps | mean Δ | mean \\|Δ\\| | max \\|Δ\\| | mean \\|Δ\\| / noise |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {q['first']}..{q['last']} | {q['mean_delta']:+.3e} | {q['mean_abs_delta']:.3e} | "
        f"{q['max_abs_delta']:.3e} | {_f(q['ratio'], '.3g')} |"
        for q in r["quarters"]
    ]
    lines += ["", "![training loss](train_loss.png)", "", "![delta training loss](delta_train_loss.png)", ""]
    return lines


def _spike_lines(s: dict[str, Any] | None, control: str, mhar: str) -> list[str]:
    """Both arms' spikes side by side ([spikes] in the configs; components/spikes.py scores them)."""
    if not s:
        return []

    def cell(arm: dict[str, Any], tag: str) -> str:
        if not arm["scored"] and not arm[tag]["count"]:
            return "not scored"
        top = arm[tag]["largest"]
        if top is None:
            return "0"
        at = _steps_text(arm[tag]["steps"])
        return (
            f"{arm[tag]['count']} (steps {at}); largest at step {top['step']}: {top['value']:.4g} against a "
            f"median of {top['median']:.4g}, score {top['score']:.1f}"
        )

    rows = [
        f"| {name} | {cell(s['control'], tag)} | {cell(s['mhar'], tag)} |"
        for tag, name in (("loss", "loss spikes"), ("grad_norm", "gradient-norm spikes"))
    ]
    return ["## Spikes", "", f"| | {control} | {mhar} |", "|---|---|---|", *rows, ""]


def ending_lines(e: dict[str, list[dict[str, Any]]] | None, control: str, mhar: str) -> list[str]:
    """How each arm's jobs ended (<run>/endings.jsonl, components/endings.py): the count of each kind, and every
    crash and hang that was restarted or not, with its step and cause."""
    if not e or not any(e.values()):
        return []

    def cell(ends: list[dict[str, Any]]) -> str:
        if not ends:
            return "none recorded"
        counts = Counter(x["class"] for x in ends)
        text = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
        failures = [f"step {x['step']}: {x['cause']}" for x in ends if x["class"] in RESTARTED]
        return text + (f" ({'; '.join(failures)})" if failures else "")

    row = f"| jobs | {cell(e.get('control', []))} | {cell(e.get('mhar', []))} |"
    return ["## How the jobs ended", "", f"| | {control} | {mhar} |", "|---|---|---|", row, ""]


def _throughput_lines(t: dict[str, Any], control: str, mhar: str) -> list[str]:
    lines = [
        "## Throughput",
        "",
        f"| | {control} | {mhar} | {mhar}/{control} |",
        "|---|---:|---:|---:|",
        f"| tokens/s per device (median after the first {WARMUP_LOGS} log steps) | {_f(t['control'], ',.0f')} | "
        f"{_f(t['mhar'], ',.0f')} | {_f(t['ratio'], '.4f')} |",
    ]
    clean, stragglers = t.get("clean"), t.get("stragglers")
    if clean is not None:
        lines.append(
            f"| the same over the {clean['windows']} log windows where neither arm had a straggling rank | "
            f"{_f(clean['control'], ',.0f')} | {_f(clean['mhar'], ',.0f')} | {_f(clean['ratio'], '.4f')} |"
        )
    lines.append("")
    if stragglers is None:
        return [*lines, "The arms logged no per-rank times (`ranks/...`): stragglers unknown.", ""]
    for arm, name in (("control", control), ("mhar", mhar)):
        s = stragglers[arm]
        said = (
            f"a rank straggled (above the median by more than `[stragglers] share`) in {s['windows']} of its "
            f"{s['of']} log windows; {s['warned']} warned as stragglers"
            if s["windows"]
            else f"no straggling rank in its {s['of']} log windows"
        )
        lines.append(f"- {name}: {said}.")
    return [*lines, ""]


def _consistency_lines(r: dict[str, Any], control: str, mhar: str) -> list[str]:
    """Whether both arms ran the same schedule and data, as a table."""
    lines = [
        "## Consistency (same schedule, same data)",
        "",
        "| series | result |",
        "|---|---|",
    ]
    n = len(r["steps"])
    lines += [f"| `{tag}` | {_check_text(r['checks'][tag], control, mhar, n)} |" for tag in CHECKED]
    data = r["checks"]["data"]
    lines += [
        f"| data counters (`data/docs`, `data/tokens/*`: {data['tags']} tags) | "
        f"{_check_text(data, control, mhar, n)} |",
        f"| recorded settings (`fingerprint.json`: base, data, schedule, precision) | {_recipe_text(r)} |",
        f"| deliberate changes (`fingerprint.json` history) | {_history_text(r['checks'].get('history'))} |",
        "",
    ]
    return lines


def _history_text(h: dict[str, Any] | None) -> str:
    if not h or h["identical"] is None:
        return "n/a (an arm has no fingerprint.json)"
    events = h["events"]["control"]
    if h["identical"]:
        listed = "; ".join(f"step {e['step']}: {'; '.join(e['changes'])}" for e in events)
        said = f"the same in both arms ({listed})" if events else "none in either arm"
    else:
        said = "**differ**: " + "; ".join(h["differences"])
    back = [
        f"{arm} back to step {r['step']} from {r['from']}"
        for arm, rows in h.get("rollbacks", {}).items()
        for r in rows
    ]  # fmt: skip
    return said + (f"; rollbacks: {', '.join(back)}" if back else "")


def _recipe_text(r: dict[str, Any]) -> str:
    recipe = r["checks"].get("recipe", {"identical": None})
    if recipe["identical"] is None:
        return "n/a (an arm has no fingerprint.json)"
    if recipe["identical"]:
        return "identical"
    return "**differ**: " + "; ".join(recipe["differences"])


def summary_lines(r: dict[str, Any]) -> list[str]:
    steps = r["steps"]
    lines = [
        f"aligned {len(steps)} steps ({steps[0]}..{steps[-1]}); only control: {len(r['only_control'])}, "
        f"only mhar: {len(r['only_mhar'])}",
        f"step {r['first_step']}: |Δ loss| {_f(r['first_step_abs_delta'])} = {_f(r['ratio_first'], '.3g')} × "
        f"control noise {_f(r['noise'])}",
        "mean |Δ|/noise per quarter: " + ", ".join(_f(q["ratio"], ".3g") for q in r["quarters"]),
    ]
    lines += cval.summary_lines(r)
    lines.append(f"tokens/s mhar/control: {_f(r['tokens_per_s']['ratio'], '.4f')}")
    if r.get("routing"):
        steps = r["routing"]["steps"]
        lines.append(f"routing: {len(steps)} logged steps of {r['routing']['layers']} layers ({steps[0]}..{steps[-1]})")
    lines.append("identical: " + ", ".join(f"{k} {r['checks'][k]['identical']}" for k in (*CHECKED, "data", "recipe")))
    if r["checks"]["recipe"]["identical"] is False:
        lines += [f"the arms recorded other settings: {d}" for d in r["checks"]["recipe"]["differences"]]
    lines += [f"wrote {p}" for p in (r["delta_dir"], r["report"], *r["plots"])]
    return lines
