"""Paired comparison of a control run and an MHAR run of the same schedule and data.

MHAR's figure of merit is the per-step loss difference to the control: near 1e-5 at step 1 and staying far
below the batch-to-batch noise. Two loss curves side by side cannot show that, and nobody reports paired deltas
with their uncertainty, so this aligns the arms step by step, writes the deltas as a TensorBoard run next to
them, sets the training delta against the control's noise and gives validation deltas a paired 95% CI over the
same batches. It also checks that both arms really saw the same LR schedule and tokens.

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

from mhar_titan.tensorboard_scalars import LOSS_TAG, load_scalars

Series = dict[int, float]

CE_TAG = "train/ce"
VAL_TAGS = {"raw": "val/ce", "ema": "val/ce_ema"}
CHECKED = ("lr/decay", "tokens_seen")
HEAD_STEPS = 5  # steps listed one by one at the start
WARMUP_LOGS = 5  # tokens/s log points left out of the median (compilation, caches)
DELTA_RUN = "delta"


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


def _val_delta(c: dict | None, m: dict | None, c_tb: float | None, m_tb: float | None) -> dict[str, Any] | None:
    """Δ val CE of one weight set at one step: per-batch files (with the paired CI) when both arms have them."""
    if c is not None and m is not None:

        def agg(b: dict) -> float:
            return sum(b["ce_sum"]) / sum(b["tokens"])

        out = {"delta": agg(m) - agg(c), "source": "batches", "n": len(c["tokens"]), "ci": None, "note": ""}
        if c["tokens"] != m["tokens"]:
            out["note"] = "per-batch token counts differ between the arms: not the same batches, no CI"
            return out
        diffs = [ms / t - cs / t for cs, ms, t in zip(c["ce_sum"], m["ce_sum"], c["tokens"], strict=True)]
        out["ci"] = paired_ci(diffs)
        if out["ci"] is None:
            out["note"] = "fewer than 2 batches: no CI"
        return out
    if c_tb is not None and m_tb is not None:
        return {"delta": m_tb - c_tb, "source": "tensorboard", "n": None, "ci": None, "note": "no per-batch files"}
    return None


def _validation(cs: dict, ms: dict, cv: dict, mv: dict) -> list[dict[str, Any]]:
    steps = set(cv) & set(mv)
    for tag in VAL_TAGS.values():
        steps |= set(cs.get(tag, {})) & set(ms.get(tag, {}))
    rows = []
    for s in sorted(steps):
        row: dict[str, Any] = {"step": s}
        for kind, tag in VAL_TAGS.items():
            row[kind] = _val_delta(
                cv.get(s, {}).get(kind), mv.get(s, {}).get(kind), cs.get(tag, {}).get(s), ms.get(tag, {}).get(s)
            )
        rows.append(row)
    return rows


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
    val = _validation(cs, ms, cv, mv)

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
    report.write_text(_report(result, control, mhar))
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

    lines += ["## Validation", ""]
    if not r["val"]:
        lines += ["No validation step in both arms.", ""]
    for kind, title in (("raw", "Raw weights (`val/ce`)"), ("ema", "EMA weights (`val/ce_ema`)")):
        rows = [(v["step"], v[kind]) for v in r["val"] if v[kind]]
        if not rows:
            continue
        lines += [
            f"### {title}",
            "",
            "| step | Δ val CE | mean per-batch Δ | 95% CI | batches | note |",
            "|---:|---:|---:|---|---:|---|",
        ]
        for step, p in rows:
            ci = p["ci"]
            span = f"[{ci['low']:+.3e}, {ci['high']:+.3e}] (±{ci['half_width']:.2e})" if ci else "n/a"
            mean = f"{ci['mean']:+.3e}" if ci else "n/a"
            lines.append(f"| {step} | {p['delta']:+.3e} | {mean} | {span} | {p['n'] or 'n/a'} | {p['note']} |")
        lines.append("")
    if r["val"]:
        lines += [
            "Δ val CE is token-weighted over all batches (as `val/ce`); the CI is paired over the same batches: "
            "mean of the per-batch CE differences ± t(0.975, n−1)·sd/√n.",
            "",
        ]
        if any(v["raw"] or v["ema"] for v in r["val"]):
            lines += ["![validation deltas](val_delta.png)", ""]

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
    if r["val"]:
        v = r["val"][-1]
        for kind in ("raw", "ema"):
            if v[kind]:
                ci = v[kind]["ci"]
                ci_text = f" (95% CI [{ci['low']:+.2e}, {ci['high']:+.2e}])" if ci else ""
                lines.append(f"val {kind} at step {v['step']}: Δ {v[kind]['delta']:+.3e}{ci_text}")
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
