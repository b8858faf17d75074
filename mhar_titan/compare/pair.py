"""Paired comparison of a control run and an MHAR run of the same schedule and data.

MHAR's figure of merit is the per-step loss difference to the control: near 1e-5 at step 1 and staying far
below the batch-to-batch noise. Two loss curves side by side cannot show that, and nobody reports paired deltas
with their uncertainty, so this aligns the arms step by step, writes the deltas as a TensorBoard run next to
them, sets the training delta against the control's noise and gives validation deltas a paired 95% CI over the
same batches. It also checks that both arms really saw the same LR schedule and tokens, and, from the step-0
validation of the base (mhar_titan.compare_validation), that both started from the same model, and how far each
arm has moved from it. From the routing statistics the MHAR arm logged, it draws its routing (routing.py).

    python -m mhar_titan.compare runs/<pair> [--out DIR] [--control NAME] [--mhar NAME]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.tensorboard import SummaryWriter

from mhar_titan.compare import bands, compute, norms, pool, replicate, report, routing, schedule
from mhar_titan.compare import validation as cval
from mhar_titan.compare.report import CHECKED
from mhar_titan.compare.stats import batch_noise, divergence, median_after_warmup
from mhar_titan.components import fingerprint, run_record, spikes
from mhar_titan.components.endings import read_endings
from mhar_titan.components.tensorboard_scalars import LOSS_TAG, load_scalars

Series = dict[int, float]

CE_TAG = "train/ce"
HEAD_STEPS = 5  # steps listed one by one at the start
DELTA_RUN = "delta"


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


def write_delta_run(
    delta_dir: Path, series: dict[str, Series], images: Sequence[tuple[str, int, np.ndarray]] = ()
) -> None:
    """The deltas as a TensorBoard run beside the arms, with the images of the comparison (tag, step,
    [H, W, 3] uint8: the MHAR arm's routing); replaces the previous run's event files."""
    delta_dir.mkdir(parents=True, exist_ok=True)
    for old in delta_dir.glob("events.out.tfevents.*"):
        old.unlink()
    writer = SummaryWriter(log_dir=str(delta_dir))
    for tag, values in series.items():
        for step, value in values.items():
            writer.add_scalar(tag, value, step)
    for tag, step, image in images:
        writer.add_image(tag, image, step, dataformats="HWC")
    writer.close()


def _ratio(x: float, noise: float | None) -> float | None:
    """|Δ| in units of the control's batch noise; None when the noise is unknown or zero."""
    return x / noise if noise else None


def _head(
    steps: list[int], deltas: list[float], c_loss: Series, m_loss: Series, noise: float | None
) -> list[dict[str, Any]]:
    """The first steps one by one: both losses, Δ and |Δ| in units of the noise."""
    return [
        {"step": s, "control": c_loss[s], "mhar": m_loss[s], "delta": d, "ratio": _ratio(abs(d), noise)}
        for s, d in zip(steps[:HEAD_STEPS], deltas, strict=False)
    ]


def _quarters(steps: list[int], deltas: list[float], noise: float | None) -> list[dict[str, Any]]:
    """The deltas summarised over each quarter of the aligned steps, to show drift over training."""
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
                    "ratio": _ratio(mean_abs, noise),
                }
            )
    return quarters


def _loss_figures(
    steps: list[int], deltas: list[float], c_loss: Series, m_loss: Series, noise: float | None
) -> dict[str, Any]:
    """The training-loss figures of the result: the first step's Δ, the noise, the head and the quarters."""
    return {
        "first_step": steps[0],
        "first_step_delta": deltas[0],
        "first_step_abs_delta": abs(deltas[0]),
        "noise": noise,
        "ratio_first": _ratio(abs(deltas[0]), noise),
        "head": _head(steps, deltas, c_loss, m_loss, noise),
        "quarters": _quarters(steps, deltas, noise),
    }


def _consistency_checks(cs: dict[str, Series], ms: dict[str, Series], steps: list[int]) -> dict[str, Any]:
    """Did both arms see the same LR schedule, tokens and data? The data check reports its earliest divergence."""
    checks = {tag: divergence(cs.get(tag), ms.get(tag), steps) for tag in CHECKED}
    data_tags = sorted(
        t for t in set(cs) | set(ms) if t == "data/docs" or t.startswith(("data/tokens/", "data/mixture/"))
    )
    data: dict[str, Any] = {"identical": True if data_tags else None}
    for tag in data_tags:
        d = divergence(cs.get(tag), ms.get(tag), steps)
        if d["identical"] is False and (data["identical"] or d["step"] < data["step"]):
            data = {**d, "tag": tag}
    checks["data"] = {**data, "tags": len(data_tags)}
    return checks


def _recipe_check(c_run: Path, m_run: Path) -> dict[str, Any]:
    """Did both arms record the same architecture apart from [mhar] (widths, attention mask), base, data and
    schedule (optimizer, LR, batch, z-loss, EMA, precision) in their fingerprint.json? None where an arm recorded
    none."""
    recorded = [fingerprint.read(str(run)) for run in (c_run, m_run)]
    if None in recorded:
        return {"identical": None, "differences": []}
    diffs = [d for d in fingerprint.differences(*recorded) if d[:2] != ("model", "mhar")]
    lines = [
        line.replace(" in the run, ", " in control, ").removesuffix(" now") + " in mhar"
        for line in fingerprint.describe(diffs)
    ]
    return {"identical": not diffs, "differences": lines}


STRAGGLING_TAG, WARNED_TAG = "ranks/straggling", "ranks/stragglers_warned"


def _history_check(c_run: Path, m_run: Path) -> dict[str, Any]:
    """Both arms' deliberate changes (fingerprint.json's history: the step and the settings each resume with
    `[checkpoint] allow_changes` applied), and whether they are the same: a change applied to one arm only, or at
    another step, unmatches the pair. `identical` None where an arm recorded no fingerprint."""
    recorded = {arm: fingerprint.read(str(run)) for arm, run in (("control", c_run), ("mhar", m_run))}
    if None in recorded.values():
        return {"identical": None, "events": {}, "differences": []}
    events = {
        arm: [(int(e["step"]), tuple(e["changes"])) for e in (rec or {}).get("history", [])]
        for arm, rec in recorded.items()
    }
    differences = []
    for step in sorted({s for arm_events in events.values() for s, _ in arm_events}):
        at = {arm: [c for s, c in arm_events if s == step] for arm, arm_events in events.items()}
        if at["control"] != at["mhar"]:
            said = {arm: "; ".join(line for c in changes for line in c) or "nothing" for arm, changes in at.items()}
            differences.append(f"step {step}: control changed {said['control']}, mhar changed {said['mhar']}")
    as_lists = {arm: [{"step": s, "changes": list(c)} for s, c in e] for arm, e in events.items()}
    rollbacks = {arm: _rollbacks(run) for arm, run in (("control", c_run), ("mhar", m_run))}
    return {"identical": not differences, "events": as_lists, "differences": differences, "rollbacks": rollbacks}


def _rollbacks(run: Path) -> list[dict[str, int]]:
    """Each start of a job from an earlier step than a job before it had reached (starts.jsonl against
    endings.jsonl, in time order): a rollback, e.g. to the checkpoint kept before a spike."""
    events = []
    starts = run / run_record.STARTS_FILE
    for line in starts.read_text().splitlines() if starts.is_file() else []:
        start = json.loads(line)
        when = datetime.strptime(start["time"], "%Y-%m-%dT%H:%M:%S%z").timestamp()
        events.append((when, "start", int(start["step"])))
    events += [(float(e["time"]), "end", int(e["step"])) for e in read_endings(str(run)) if "step" in e]
    reached, out = -1, []
    for _, kind, step in sorted(events):
        if kind == "start" and step < reached:
            out.append({"step": step, "from": reached})
        reached = max(reached, step)
    return out


def _tokens_per_s(cs: dict[str, Series], ms: dict[str, Series]) -> dict[str, Any]:
    """Each arm's median tokens/s and their ratio; each arm's log windows with a rank slower than the others
    (components/rank_timing.py), and the ratio again over the windows where neither arm had one."""
    tps: dict[str, Any] = {
        "control": median_after_warmup(cs.get("tokens_per_s")),
        "mhar": median_after_warmup(ms.get("tokens_per_s")),
    }
    tps["ratio"] = tps["mhar"] / tps["control"] if tps["control"] and tps["mhar"] is not None else None
    timed = STRAGGLING_TAG in cs and STRAGGLING_TAG in ms
    tps["stragglers"] = {
        arm: {
            "windows": sum(1 for v in s.get(STRAGGLING_TAG, {}).values() if v),
            "of": len(s.get(STRAGGLING_TAG, {})),
            "warned": int(max(s.get(WARNED_TAG, {0: 0.0}).values())),
        }
        for arm, s in (("control", cs), ("mhar", ms))
    } if timed else None  # fmt: skip
    if timed:
        clean = {
            step for step in set(cs[STRAGGLING_TAG]) & set(ms[STRAGGLING_TAG])
            if not cs[STRAGGLING_TAG][step] and not ms[STRAGGLING_TAG][step]
        }  # fmt: skip
        c_clean = {k: v for k, v in cs.get("tokens_per_s", {}).items() if k in clean}
        m_clean = {k: v for k, v in ms.get("tokens_per_s", {}).items() if k in clean}
        c, m = median_after_warmup(c_clean), median_after_warmup(m_clean)
        tps["clean"] = {"windows": len(clean), "control": c, "mhar": m, "ratio": m / c if c and m is not None else None}
    return tps


def _val_delta_series(val: list[dict[str, Any]], changes: dict[str, list[dict[str, Any]]]) -> dict[str, Series]:
    """The validation deltas between the arms (with their CI bounds) and each arm's change from the base."""
    series: dict[str, Series] = {}
    for kind, tag in (("raw", "delta/val_ce"), ("ema", "delta/val_ce_ema")):
        points = [(r["step"], r[kind]) for r in val if r[kind] is not None]
        if points:
            series[tag] = {s: p["delta"] for s, p in points}
            with_ci = [(s, p["ci"]) for s, p in points if p["ci"] is not None]
            if with_ci:
                series[f"{tag}_ci_low"] = {s: ci["low"] for s, ci in with_ci}
                series[f"{tag}_ci_high"] = {s: ci["high"] for s, ci in with_ci}
    for role, rows in changes.items():
        for kind, tag in cval.VAL_TAGS.items():
            points = {row["step"]: row[kind]["delta"] for row in rows if row[kind]}
            if points:
                series[f"from_base/{role}/{tag.replace('/', '_')}"] = points
    return series


def _delta_series(
    cs: dict[str, Series],
    ms: dict[str, Series],
    steps: list[int],
    deltas: list[float],
    val: list[dict[str, Any]],
    changes: dict[str, list[dict[str, Any]]],
) -> dict[str, Series]:
    """Every series of the delta TensorBoard run: training loss and CE deltas, then the validation ones."""
    series: dict[str, Series] = {
        "delta/train_loss": dict(zip(steps, deltas, strict=True)),
        "delta/abs_train_loss": {s: abs(d) for s, d in zip(steps, deltas, strict=True)},
    }
    if CE_TAG in cs and CE_TAG in ms:
        series["delta/train_ce"] = {
            s: ms[CE_TAG][s] - cs[CE_TAG][s] for s in steps if s in cs[CE_TAG] and s in ms[CE_TAG]
        }
    series.update(_val_delta_series(val, changes))
    series.update(norms.delta_series(cs, ms))
    return series


def _write_routing_and_deltas(
    out: Path, delta_dir: Path, ms: dict[str, Series], m_run: Path, delta_series: dict[str, Series]
) -> tuple[routing.RoutingLog | None, list[Path]]:
    """Draws the MHAR arm's routing into `out` and writes the delta run with its images; returns the
    routing log (None when the arm logged none) and the routing plots."""
    out.mkdir(parents=True, exist_ok=True)
    routing_log = routing.read_routing(ms, m_run)
    routing_plots, routing_images = routing.write(out, routing_log)
    write_delta_run(delta_dir, delta_series, routing_images)
    return routing_log, routing_plots


def compare(
    pair_dir: str | Path, out_dir: str | Path | None = None, control: str = "control", mhar: str = "mhar"
) -> dict[str, Any]:
    """Aligns the arms of a pair by step, writes `<pair>/delta/`, report.md and plots; returns the key figures."""
    pair = Path(pair_dir)
    if {DELTA_RUN, replicate.ARM} & {control, mhar}:
        raise ValueError(f"an arm cannot be named {DELTA_RUN!r} or {replicate.ARM!r}: the deltas, the A/A run")
    out = Path(out_dir) if out_dir is not None else pair / "compare"
    c_run, cs, cv = _arm(pair, control)
    m_run, ms, mv = _arm(pair, mhar)
    c_loss, m_loss = cs[LOSS_TAG], ms[LOSS_TAG]
    steps = sorted(set(c_loss) & set(m_loss))
    if not steps:
        raise ValueError(f"{c_run} and {m_run} have no {LOSS_TAG!r} step in common")
    deltas = [m_loss[s] - c_loss[s] for s in steps]
    noise = batch_noise([c_loss[s] for s in steps])
    val = cval.validation(cs, ms, cv, mv)
    base = cval.base_check(cs, ms, cv, mv)
    changes = {"control": cval.from_base(cs, cv), "mhar": cval.from_base(ms, mv)}
    sets = cval.named_sets(cs, ms, cv, mv)
    checks = _consistency_checks(cs, ms, steps)
    checks["recipe"] = _recipe_check(c_run, m_run)
    checks["history"] = _history_check(c_run, m_run)
    tps = _tokens_per_s(cs, ms)
    delta_series = _delta_series(cs, ms, steps, deltas, val, changes)
    aa = None
    if (pair / replicate.ARM).is_dir():  # launch/pair.sh --replicate: the A/A run
        r_run, rs, rv = _arm(pair, replicate.ARM)
        aa = replicate.summary(c_run, r_run, cs, ms, rs, cv, mv, rv)
        delta_series.update(replicate.delta_series(rs, cs))
    delta_dir = pair / DELTA_RUN
    routing_log, routing_plots = _write_routing_and_deltas(out, delta_dir, ms, m_run, delta_series)
    stages = schedule.summary(cs, ms, c_run)
    schedule_plot = schedule.plot(out, cs, ms, stages)
    layer_norms = norms.summary(cs, ms)
    norms_plot = norms.plot(out, layer_norms, control, mhar)

    result: dict[str, Any] = {
        "pair": str(pair),
        "arms": {"control": str(c_run), "mhar": str(m_run)},
        "steps": steps,
        "only_control": sorted(set(c_loss) - set(m_loss)),
        "only_mhar": sorted(set(m_loss) - set(c_loss)),
        **_loss_figures(steps, deltas, c_loss, m_loss, noise),
        "val": val,
        "base": base,
        "base_identical": base["identical"],
        "from_base": changes,
        "validation_sets": sets,
        "tokens_per_s": tps,
        "checks": checks,
        "lr_identical": checks["lr/decay"]["identical"],
        "tokens_identical": checks["tokens_seen"]["identical"],
        "data_identical": checks["data"]["identical"],
        "delta_dir": str(delta_dir),
        "routing": routing.summary(routing_log) if routing_log is not None else None,
        "stages": stages,
        "schedule_drawn": schedule_plot is not None,
        "norms": layer_norms,
        "equal_compute": compute.summary(cs, ms),
        "bands": bands.summary(cv, mv),
        "replicate": aa,
        "spikes": {
            arm: {"scored": "spikes/loss_count" in s, **spikes.summary(str(run))}
            for arm, run, s in (("control", c_run, cs), ("mhar", m_run, ms))
        },
        "endings": {arm: read_endings(str(run)) for arm, run in (("control", c_run), ("mhar", m_run))},
    }
    plots = [*routing_plots, *([schedule_plot] if schedule_plot else []), *([norms_plot] if norms_plot else [])]
    _write_report(result, out, c_loss, m_loss, deltas, plots, control, mhar)
    return result


def _write_report(
    result: dict[str, Any],
    out: Path,
    c_loss: Series,
    m_loss: Series,
    deltas: list[float],
    extra_plots: list[Path],
    control: str,
    mhar: str,
) -> None:
    """Draws the plots and writes report.md, keeping mhar_titan.eval's eval.md appended when it is there;
    records both paths in `result`."""
    steps, noise, val = result["steps"], result["noise"], result["val"]
    plots = report.plots(out, steps, c_loss, m_loss, deltas, noise, val, control, mhar) + extra_plots
    result["plots"] = [str(p) for p in plots]
    report_md, evaluation = out / "report.md", out / "eval.md"  # eval.md: mhar_titan.eval's, kept when redone
    text = report.report_text(result, control, mhar)
    report_md.write_text(text + ("\n" + evaluation.read_text() if evaluation.exists() else ""))
    result["report"] = str(report_md)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Paired comparison of the control and mhar runs of a pair.")
    parser.add_argument("pair_dir", nargs="+", help="folder holding the runs, e.g. runs/<pair>; several: pooled")
    parser.add_argument("--out", help="report folder (default <pair_dir>/compare; pooled: <parent>/pooled)")
    parser.add_argument("--control", default="control", help="subfolder of the control run")
    parser.add_argument("--mhar", default="mhar", help="subfolder of the MHAR run")
    args = parser.parse_args(argv)
    several = len(args.pair_dir) > 1
    try:
        results = [
            compare(d, None if several else args.out, args.control, args.mhar) for d in args.pair_dir
        ]  # fmt: skip
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"compare: {e}")
    for result in results:
        print("\n".join(report.summary_lines(result)))
    if several:
        out = Path(args.out) if args.out else Path(args.pair_dir[0]).resolve().parent / "pooled"
        print(f"wrote {pool.write(out, pool.pooled(results))}")
