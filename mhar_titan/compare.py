"""Paired comparison of a control run and an MHAR run of the same schedule and data.

MHAR's figure of merit is the per-step loss difference to the control: near 1e-5 at step 1 and staying far
below the batch-to-batch noise. Two loss curves side by side cannot show that, and nobody reports paired deltas
with their uncertainty, so this aligns the arms step by step, writes the deltas as a TensorBoard run next to
them, sets the training delta against the control's noise and gives validation deltas a paired 95% CI over the
same batches. It also checks that both arms really saw the same LR schedule and tokens, and, from the step-0
validation of the base (mhar_titan.compare_validation), that both started from the same model, and how far each
arm has moved from it.

    python -m mhar_titan.compare runs/<pair> [--out DIR] [--control NAME] [--mhar NAME]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch.utils.tensorboard import SummaryWriter

from mhar_titan import compare_validation as cval
from mhar_titan.compare_validation import paired_ci as paired_ci  # re-exported: mhar_titan.eval uses it
from mhar_titan.compare_validation import t_quantile as t_quantile
from mhar_titan.tensorboard_scalars import LOSS_TAG, load_scalars

Series = dict[int, float]

CE_TAG = "train/ce"
CHECKED = ("lr/decay", "tokens_seen")
HEAD_STEPS = 5  # steps listed one by one at the start
WARMUP_LOGS = 5  # tokens/s log points left out of the median (compilation, caches)
DELTA_RUN = "delta"


def batch_noise(losses: list[float]) -> float | None:
    """Per-step noise of a loss series around its trend: sd of successive differences / √2.

    Differencing removes a slowly varying trend; independent noise of sd σ gives differences of variance 2σ².
    """
    if len(losses) < 3:
        return None
    return statistics.stdev(b - a for a, b in zip(losses, losses[1:], strict=False)) / math.sqrt(2)


def _arm(pair: Path, name: str) -> tuple[Path, dict[str, Series], dict[int, dict]]:
    run = pair / name
    if not run.is_dir():
        raise FileNotFoundError(f"arm folder {run} does not exist")
    scalars = load_scalars(run)
    if LOSS_TAG not in scalars:
        raise ValueError(f"no {LOSS_TAG!r} scalars in the event files under {run}")
    val = {}
    for path in sorted((run / "validation").glob("step-*.json")):
        data = json.loads(path.read_text())
        val[int(data["step"])] = data
    return run, scalars, val


def _divergence(c: Series | None, m: Series | None, steps: list[int]) -> dict[str, Any]:
    """Identical on the aligned steps, or the first step where the values differ or one is missing."""
    if c is None and m is None:
        return {"identical": None}
    for s in steps:
        a, b = (c or {}).get(s), (m or {}).get(s)
        if a != b:
            return {"identical": False, "step": s, "control": a, "mhar": b}
    return {"identical": True}


def _median_after_warmup(series: Series | None) -> float | None:
    if not series:
        return None
    values = list(series.values())
    return statistics.median(values[WARMUP_LOGS:] or values)


def write_delta_run(delta_dir: Path, series: dict[str, Series]) -> None:
    """The deltas as a TensorBoard run beside the arms; replaces the previous run's event files."""
    delta_dir.mkdir(parents=True, exist_ok=True)
    for old in delta_dir.glob("events.out.tfevents.*"):
        old.unlink()
    writer = SummaryWriter(log_dir=str(delta_dir))
    for tag, values in series.items():
        for step, value in values.items():
            writer.add_scalar(tag, value, step)
    writer.close()


def compare(
    pair_dir: str | Path, out_dir: str | Path | None = None, control: str = "control", mhar: str = "mhar"
) -> dict[str, Any]:
    """Aligns the arms of a pair by step, writes `<pair>/delta/`, report.md and plots; returns the key figures."""
    pair = Path(pair_dir)
    if DELTA_RUN in (control, mhar):
        raise ValueError(f"an arm cannot be named {DELTA_RUN!r}: that folder holds the deltas")
    out = Path(out_dir) if out_dir is not None else pair / "compare"
    c_run, cs, cv = _arm(pair, control)
    m_run, ms, mv = _arm(pair, mhar)
    c_loss, m_loss = cs[LOSS_TAG], ms[LOSS_TAG]
    steps = sorted(set(c_loss) & set(m_loss))
    if not steps:
        raise ValueError(f"{c_run} and {m_run} have no {LOSS_TAG!r} step in common")
    deltas = [m_loss[s] - c_loss[s] for s in steps]
    noise = batch_noise([c_loss[s] for s in steps])

    def ratio(x: float) -> float | None:
        return x / noise if noise else None

    n = len(steps)
    quarters = []
    for q in range(4):
        lo, hi = q * n // 4, (q + 1) * n // 4
        if lo < hi:
            part = [abs(d) for d in deltas[lo:hi]]
            mean_abs = statistics.fmean(part)
            quarters.append(
                {
                    "first": steps[lo],
                    "last": steps[hi - 1],
                    "mean_delta": statistics.fmean(deltas[lo:hi]),
                    "mean_abs_delta": mean_abs,
                    "max_abs_delta": max(part),
                    "ratio": ratio(mean_abs),
                }
            )
    head = [
        {"step": s, "control": c_loss[s], "mhar": m_loss[s], "delta": d, "ratio": ratio(abs(d))}
        for s, d in zip(steps[:HEAD_STEPS], deltas, strict=False)
    ]
    val = cval.validation(cs, ms, cv, mv)
    base = cval.base_check(cs, ms, cv, mv)
    changes = {"control": cval.from_base(cs, cv), "mhar": cval.from_base(ms, mv)}

    checks = {tag: _divergence(cs.get(tag), ms.get(tag), steps) for tag in CHECKED}
    data_tags = sorted(t for t in set(cs) | set(ms) if t == "data/docs" or t.startswith("data/tokens/"))
    data: dict[str, Any] = {"identical": True if data_tags else None}
    for tag in data_tags:
        d = _divergence(cs.get(tag), ms.get(tag), steps)
        if d["identical"] is False and (data["identical"] or d["step"] < data["step"]):
            data = {**d, "tag": tag}
    checks["data"] = {**data, "tags": len(data_tags)}

    tps = {
        "control": _median_after_warmup(cs.get("tokens_per_s")),
        "mhar": _median_after_warmup(ms.get("tokens_per_s")),
    }
    tps["ratio"] = tps["mhar"] / tps["control"] if tps["control"] and tps["mhar"] is not None else None

    delta_series: dict[str, Series] = {
        "delta/train_loss": dict(zip(steps, deltas, strict=True)),
        "delta/abs_train_loss": {s: abs(d) for s, d in zip(steps, deltas, strict=True)},
    }
    if CE_TAG in cs and CE_TAG in ms:
        delta_series["delta/train_ce"] = {
            s: ms[CE_TAG][s] - cs[CE_TAG][s] for s in steps if s in cs[CE_TAG] and s in ms[CE_TAG]
        }
    for kind, tag in (("raw", "delta/val_ce"), ("ema", "delta/val_ce_ema")):
        points = [(r["step"], r[kind]) for r in val if r[kind] is not None]
        if points:
            delta_series[tag] = {s: p["delta"] for s, p in points}
            with_ci = [(s, p["ci"]) for s, p in points if p["ci"] is not None]
            if with_ci:
                delta_series[f"{tag}_ci_low"] = {s: ci["low"] for s, ci in with_ci}
                delta_series[f"{tag}_ci_high"] = {s: ci["high"] for s, ci in with_ci}
    for role, rows in changes.items():
        for kind, tag in cval.VAL_TAGS.items():
            points = {row["step"]: row[kind]["delta"] for row in rows if row[kind]}
            if points:
                delta_series[f"from_base/{role}/{tag.replace('/', '_')}"] = points
    delta_dir = pair / DELTA_RUN
    write_delta_run(delta_dir, delta_series)

    result: dict[str, Any] = {
        "pair": str(pair),
        "arms": {"control": str(c_run), "mhar": str(m_run)},
        "steps": steps,
        "only_control": sorted(set(c_loss) - set(m_loss)),
        "only_mhar": sorted(set(m_loss) - set(c_loss)),
        "first_step": steps[0],
        "first_step_delta": deltas[0],
        "first_step_abs_delta": abs(deltas[0]),
        "noise": noise,
        "ratio_first": ratio(abs(deltas[0])),
        "head": head,
        "quarters": quarters,
        "val": val,
        "base": base,
        "base_identical": base["identical"],
        "from_base": changes,
        "tokens_per_s": tps,
        "checks": checks,
        "lr_identical": checks["lr/decay"]["identical"],
        "tokens_identical": checks["tokens_seen"]["identical"],
        "data_identical": checks["data"]["identical"],
        "delta_dir": str(delta_dir),
    }
    out.mkdir(parents=True, exist_ok=True)
    result["plots"] = [str(p) for p in _plots(out, steps, c_loss, m_loss, deltas, noise, val, control, mhar)]
    report = out / "report.md"
    evaluation = out / "eval.md"  # written by mhar_titan.eval; kept when the comparison is redone
    report.write_text(_report(result, control, mhar) + ("\n" + evaluation.read_text() if evaluation.exists() else ""))
    result["report"] = str(report)
    return result


def _plots(
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
    def save(fig: Figure, name: str) -> Path:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        return out / name

    fig = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(steps, [c_loss[s] for s in steps], lw=0.8, label=control)
    ax.plot(steps, [m_loss[s] for s in steps], lw=0.8, label=mhar, alpha=0.8)
    ax.set(xlabel="step", ylabel=LOSS_TAG, title="training loss")
    ax.legend()
    paths = [save(fig, "train_loss.png")]

    fig = Figure(figsize=(8, 6.5))
    FigureCanvasAgg(fig)
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
    paths.append(save(fig, "delta_train_loss.png"))

    stale = out / "val_delta.png"
    stale.unlink(missing_ok=True)
    if any(r["raw"] or r["ema"] for r in val):
        fig = Figure(figsize=(8, 4.5))
        FigureCanvasAgg(fig)
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
        paths.append(save(fig, "val_delta.png"))
    return paths


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


def _report(r: dict[str, Any], control: str, mhar: str) -> str:
    steps, noise = r["steps"], r["noise"]
    first_loss = r["head"][0]["control"]
    ulp = 2.0 ** (math.frexp(first_loss)[1] - 24) if first_loss else None
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
    lines += [
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

    lines += cval.report_lines(r, control, mhar)

    t = r["tokens_per_s"]
    lines += [
        "## Throughput",
        "",
        f"| | {control} | {mhar} | {mhar}/{control} |",
        "|---|---:|---:|---:|",
        f"| tokens/s per device (median after the first {WARMUP_LOGS} log steps) | {_f(t['control'], ',.0f')} | "
        f"{_f(t['mhar'], ',.0f')} | {_f(t['ratio'], '.4f')} |",
        "",
        "## Consistency (same schedule, same data)",
        "",
        "| series | result |",
        "|---|---|",
    ]
    n = len(steps)
    lines += [f"| `{tag}` | {_check_text(r['checks'][tag], control, mhar, n)} |" for tag in CHECKED]
    data = r["checks"]["data"]
    lines += [
        f"| data counters (`data/docs`, `data/tokens/*`: {data['tags']} tags) | "
        f"{_check_text(data, control, mhar, n)} |",
        "",
    ]
    return "\n".join(lines)


def _summary(r: dict[str, Any]) -> list[str]:
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
    lines.append("identical: " + ", ".join(f"{k} {r['checks'][k]['identical']}" for k in (*CHECKED, "data")))
    lines += [f"wrote {p}" for p in (r["delta_dir"], r["report"], *r["plots"])]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Paired comparison of the control and mhar runs of a pair.")
    parser.add_argument("pair_dir", help="folder holding the two runs, e.g. runs/<pair>")
    parser.add_argument("--out", help="report folder (default <pair_dir>/compare)")
    parser.add_argument("--control", default="control", help="subfolder of the control run")
    parser.add_argument("--mhar", default="mhar", help="subfolder of the MHAR run")
    args = parser.parse_args(argv)
    try:
        result = compare(args.pair_dir, args.out, args.control, args.mhar)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"compare: {e}")
    print("\n".join(_summary(result)))


if __name__ == "__main__":
    main()
