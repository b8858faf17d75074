"""The table's rows d, e, f and i from what the pair left: pure functions of the measured values, so that each
verdict's rule can be read, and tested, on its own."""

from __future__ import annotations

import math
from typing import Any

from mhar_titan.compare.stats import batch_noise
from mhar_titan.preflight.pair import harmonic_rate
from mhar_titan.preflight.stages import Stage

MEMORY_TOLERANCE = 0.05  # the plan's peak within 5% of the measured one (it is within 0.6% on one H200)
START_NOISE_FRACTION = 0.1  # the arms' step-1 |delta loss| below a tenth of the control's batch-to-batch noise
# A resumed job's gap from the uninterrupted one, over the gap between two relaunches of the same steps: at most
# this (docs/preflight.md gives this ratio as measured on an H100, and the faults').
SPREAD_FACTOR = 10.0
WARMUP_STEPS = 3  # the first steps of a job compile and warm up: out of the tokens/s


def _first_beyond(r: dict[str, Any], bound: float) -> tuple[int, str]:
    """The first step at which the resumed or rerun job is further from the killed one than `bound` (the gaps' rms
    over that step's values), and the tag that differs most there; else the step of the largest difference."""
    for step in r["resumed_gap"]["by_step"]:
        if max(r[g]["by_step"].get(step, 0.0) for g in ("resumed_gap", "rerun_gap")) > bound:
            return step, _worst_tag(r, step)
    worst = max((r["resumed_gap"], r["rerun_gap"]), key=lambda g: g["max"])
    return worst["max_step"], worst["max_tag"]


def _worst_tag(r: dict[str, Any], step: int) -> str:
    g = max((r["resumed_gap"], r["rerun_gap"]), key=lambda g: g["by_step"].get(step, 0.0))
    return g["worst_tag_by_step"].get(step, "?")


def spread_ratio(check: dict[str, Any]) -> float | None:
    """The relaunches' larger gap from the uninterrupted job over their gap from each other (inf where they are
    bitwise equal to each other but not to it; None without a rerun or where all three agree)."""
    r = check.get("rerun")
    if r is None:
        return None
    far, spread = max(r["resumed_gap"]["rms"], r["rerun_gap"]["rms"]), r["spread"]["rms"]
    return far / spread if spread else (math.inf if far else None)


def _exact_problem(arm: str, check: dict[str, Any]) -> str | None:
    """What a correct resume keeps exact on any GPU, where it did not: a value not logged, a counter (LR, tokens,
    data position) that differs, or any difference where the two relaunches are bitwise equal to each other."""
    r = check["rerun"]
    if r is None:
        return (
            f"{arm}: the resumed job differs from the killed one at step {check['first_differing_step']} "
            f"({check['differing_values']} of {check['values']} values; largest relative loss difference "
            f"{check['max_rel_loss_diff']:.3g}) and no rerun measured this job's spread"
        )
    if r["missing"]:
        step, tag, job = r["missing"][0]
        return f"{arm}: the {job} logged no {tag} at step {step}, which the killed job logged"
    if r["counters"]:
        d = r["counters"][0]
        job = "rerun" if d.get("run") == "rerun" else "resumed job"
        return (
            f"{arm}: the {job}'s {d['tag']} differs from the killed job's at step {d['step']} ({d['resumed']!r} "
            f"against {d['killed']!r}): the resume restored another data position, schedule or token count"
        )
    if r["relaunches_equal"]:
        d = check["differ"][0]
        return (
            f"{arm}: the resumed job differs from the killed one at step {d['step']} ({d['tag']}: {d['resumed']!r} "
            f"against {d['killed']!r}) while its two relaunches are bitwise equal: this job repeats exactly here, "
            "so the resume must too"
        )
    return None


def resume_verdict(arm: str, check: dict[str, Any], losses: dict[int, float]) -> tuple[bool, str, list[str]]:
    """(passed, the figure, detail lines) for one arm's resume. Bitwise equal passes. Otherwise the rerun decides:
    what must be exact is (_exact_problem); each relaunch lies within SPREAD_FACTOR x the spread between the two
    (rms of the judged values' scaled differences, docs/preflight.md); and every loss
    difference is below START_NOISE_FRACTION of the run's batch noise."""
    steps = check["steps"]
    if not steps:
        return False, f"{arm}: the killed job logged no step after the checkpoint", []
    if check["equal"]:
        return True, f"{arm} steps {steps[0]}-{steps[-1]} bitwise", []
    problem = _exact_problem(arm, check)
    if problem:
        return False, problem, []
    r = check["rerun"]
    spread, ratio = r["spread"]["rms"], spread_ratio(check) or 0.0
    details = [
        f"- {arm}: resumed and rerun each against the uninterrupted job: {r['resumed_gap']['rms']:.3g} and "
        f"{r['rerun_gap']['rms']:.3g} (rms of {r['spread']['values']} values of {r['judged']} tags: losses, grad "
        f"norm, validation; each over its tag's largest value); the two relaunches against each other (this job's "
        f"spread here): {spread:.3g}.",
        f"- {arm}: routing statistics ({r['routing_tags']} tags), reported, not judged: the resumed job within "
        f"{r['routing_gap']:.2g} of the uninterrupted one's values, the two relaunches {r['routing_spread']:.2g} "
        "apart.",
    ]
    if ratio > SPREAD_FACTOR:
        step, tag = _first_beyond(r, SPREAD_FACTOR * spread)
        far = max(r["resumed_gap"]["rms"], r["rerun_gap"]["rms"])
        return (
            False,
            (
                f"{arm}: the resume differs from the uninterrupted job from step {step} ({tag}): {far:.3g}, "
                f"{ratio:.3g}x the spread of two relaunches ({spread:.3g}; bound {SPREAD_FACTOR:g}x)"
            ),
            details,
        )
    noise = batch_noise([losses[k] for k in sorted(losses)])
    loss = check["max_abs_loss_diff"] or 0.0
    if noise is None or loss > START_NOISE_FRACTION * noise:
        return (
            False,
            (
                f"{arm}: the resumed loss differs by up to {loss:.3g}, beyond {START_NOISE_FRACTION} of the batch "
                f"noise ({noise or 0:.3g}), though within {ratio:.2g}x the relaunches' spread"
            ),
            details,
        )
    details.append(
        f"- {arm}: not bit for bit, and within this job's own run-to-run spread: {ratio:.2g}x it (bound "
        f"{SPREAD_FACTOR:g}x); the loss differs by at most {loss:.2g} ({check['max_rel_loss_diff']:.2g} relative, "
        f"{loss / noise:.2g} of the batch noise {noise:.3g}); counters (LR, tokens, data) identical in both relaunches."
    )
    return True, f"{arm} steps {steps[0]}-{steps[-1]} within {ratio:.2g}x the rerun spread", details


def pair_stage(arms: dict[str, dict[str, Any]], s: Any, depth: str, seconds: float) -> Stage:
    """d: both arms trained, validated at step 0 and at the end, killed after the checkpoint, resumed (bit for bit,
    or within the job's own spread measured by a rerun: resume_verdict), and the MHAR arm's gates moved."""
    problems, details, figures = [], [], []
    resume_failed = False
    for arm, r in arms.items():
        check = r["resume"]
        val = r["resumed"]["scalars"].get("val/ce", {})
        if 0 not in val or s.steps not in val:
            problems.append(f"{arm}: validation at steps {sorted(val)}, expected 0 and {s.steps}")
        if check is None:
            figures.append(f"{arm} uninterrupted")
            details.append(
                f"- {arm}: one job from the base to step {s.steps}, not killed (`--kill both` kills it too)."
            )
            continue
        ok, figure, lines = resume_verdict(arm, check, r["killed"]["scalars"].get("train/loss", {}))
        (figures if ok else problems).append(figure)
        resume_failed = resume_failed or not ok
        details += lines
        steps = check["steps"]
        span = f"steps {steps[0]}-{steps[-1]}" if steps else "no step"
        rerun = check["rerun"]
        details.append(
            f"- {arm}: first job killed (SIGKILL to the launcher's group) after step {r['killed']['killed_at']}, "
            f"the step-{s.checkpoint_at} checkpoint complete; "
            + (
                f"a rerun from it killed at the same step ({'bitwise equal to' if rerun['equal'] else 'not bitwise'} "
                "the first job); "
                if rerun
                else ""
            )
            + f"the relaunch resumed from it and trained to step {s.steps}; {check['values']} values "
            f"({check['tags']} tags) of {span} compared: "
            + (
                "all identical."
                if check["equal"]
                else f"{check['differing_values']} differ (first: {check['differ'][:3]})."
            )
        )
    moved = arms.get("mhar", {}).get("gates")
    if moved is None or moved == 0:
        problems.append("mhar: the routing gates did not move (no gate statistics, or all gates still 0)")
    else:
        details.append(f"- mhar: largest |gate| at the last statistics step: {moved:.3g} (0 at init).")
    figure = f"{depth}; {s.steps} steps an arm, SIGKILL after the step-{s.checkpoint_at} checkpoint; " + ", ".join(
        figures
    )
    if problems:
        details += [f"- **{p}**" for p in problems]
        figure = "; ".join(problems)
    if resume_failed:
        details.append(
            "- A resume that differs from the uninterrupted job by more than two relaunches differ from each other: "
            "something of the state is not restored (data position, optimizer, schedule, EMA) or the restart "
            "changes the arithmetic (a recompile to other kernels); see the arm's logs (killed, rerun, resumed)."
        )
    return Stage("d", "pair: train, kill, resume", not problems, figure, seconds, details)


def speed_memory_stage(arms: dict[str, dict[str, Any]], plan_peaks: dict[str, float] | None, s: Any) -> Stage:
    """e: each arm's tokens/s over its first job's steady steps and the ratio; each arm's peak active memory
    (over both jobs, validation and checkpoints included) against the memory plan, on GPUs."""
    rates, peaks, where = {}, {}, {}
    for arm, r in arms.items():
        killed = r["killed"]["scalars"]
        rates[arm] = harmonic_rate(killed.get("tokens_per_s", {}), WARMUP_STEPS + 1, s.checkpoint_at)
        # every rank's peak (the largest, and whose): rank 0 alone writes TensorBoard
        tag = "memory/peak_active_gib_max" if "memory/peak_active_gib_max" in killed else "memory/peak_active_gib"
        series = {**killed.get(tag, {}), **r["resumed"]["scalars"].get(tag, {})}
        ranks = {
            **killed.get("memory/peak_active_rank", {}),
            **r["resumed"]["scalars"].get("memory/peak_active_rank", {}),
        }
        peaks[arm] = max(series.values(), default=None)
        where[arm] = int(ranks[max(series, key=series.__getitem__)]) if ranks and series else 0
    ratio = rates["mhar"] / rates["control"] if rates.get("control") and rates.get("mhar") else None
    details = [
        f"- tokens/s per device over steps {WARMUP_STEPS + 1}-{s.checkpoint_at} of each arm's first job: "
        + ", ".join(f"{a} {v:,.0f}" if v else f"{a} -" for a, v in rates.items())
        + (f"; MHAR/control {ratio:.4f}" if ratio else "")
    ]
    problems = []
    if plan_peaks is None:
        details.append("- memory: CPU ranks, not judged (the plan is for GPUs)")
    else:
        for arm in arms:
            got, want = peaks[arm], plan_peaks[arm]
            if got is None:
                problems.append(f"{arm}: no memory figure logged")
                continue
            off = got / want - 1
            details.append(
                f"- {arm}: peak active {got:.2f} GiB (rank {where[arm]}, the largest of every rank's over both jobs), "
                f"the plan {want:.2f} GiB ({off:+.1%})"
            )
            if abs(off) > MEMORY_TOLERANCE:
                problems.append(
                    f"{arm} peak {got:.2f} GiB (rank {where[arm]}) is {off:+.1%} off the plan's {want:.2f} GiB"
                )
    tps = ", ".join(f"{a} {v:,.0f} tok/s" for a, v in rates.items() if v)
    mem = ", ".join(f"{a} {v:.1f} GiB (rank {where[a]})" for a, v in peaks.items() if v is not None)
    figure = f"{tps}; MHAR/control {ratio:.3f}; peak {mem}" if ratio else f"{tps}; peak {mem}"
    if plan_peaks is not None:
        figure += " (plan " + ", ".join(f"{plan_peaks[a]:.1f}" for a in arms) + ")"
    if problems:
        figure = "; ".join(problems)
        details.append(
            "- A peak beyond the plan: run `python -m mhar_titan.plan` for the real job and keep its margin, or "
            "report the figures (the plan is checked on one H200; other GPUs or versions may allocate differently)."
        )
    return Stage("e", "speed and memory", not problems, figure, 0.0, details)


def start_stage(compared: dict[str, Any]) -> Stage:
    """f: MHAR at init computes the base, so step 1's losses differ only by arithmetic: far below batch noise."""
    delta, noise = compared["first_step_abs_delta"], compared["noise"]
    control = compared["head"][0]["control"]
    rel = delta / abs(control) if control else None
    ok = delta == 0 or (noise is not None and delta <= START_NOISE_FRACTION * noise)
    ratio = f"{delta / noise:.2g} of" if noise else "no"
    figure = f"step-1 |delta loss| {delta:.3g} ({rel:.2g} relative), {ratio} the control's batch noise {noise or 0:.3g}"
    details = [
        f"- step 1: control {control:.9g}, MHAR {compared['head'][0]['mhar']:.9g}; batch noise (sd of successive "
        f"loss differences / sqrt 2) {noise or 0:.4g}; bound: {START_NOISE_FRACTION} of the noise.",
        "- bitwise 0 on CPU; on GPUs the arms' compiled graphs differ, so the last bits may (the paper's Figure 5).",
    ]
    if not ok:
        details.append("- **The arms do not start from the same function: check that both load the same base.**")
    return Stage("f", "graft's start", ok, figure, 0.0, details)


def compare_stage(compared: dict[str, Any] | None, error: str | None, seconds: float) -> Stage:
    """i: the paired comparison as mhar_titan.compare writes it, with its identity checks."""
    if compared is None:
        return Stage("i", "report", False, error or "no comparison", seconds, [])
    checks = {
        "LR": compared["lr_identical"],
        "tokens seen": compared["tokens_identical"],
        "data": compared["data_identical"],
    }
    bad = [k for k, v in checks.items() if v is False]
    base = compared["base_identical"]
    figure = (
        f"{compared['report']}: LR, tokens and data identical"
        if not bad
        else f"{', '.join(bad)} differ between the arms"
    )
    figure += "; step-0 validation " + (
        "identical" if base else "not bitwise identical (see f)" if base is False else "-"
    )
    details = [f"- {k}: {'identical' if v else 'DIFFER' if v is False else 'not logged'}" for k, v in checks.items()]
    return Stage("i", "report", not bad, figure, seconds, details)
