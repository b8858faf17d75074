"""The table's rows d, e, f and i from what the pair left: pure functions of the measured values, so that each
verdict's rule can be read, and tested, on its own."""

from __future__ import annotations

from typing import Any

from mhar_titan.compare.stats import batch_noise
from mhar_titan.preflight.pair import harmonic_rate
from mhar_titan.preflight.stages import Stage

MEMORY_TOLERANCE = 0.05  # the plan's peak within 5% of the measured one (it is within 0.6% on one H200)
START_NOISE_FRACTION = 0.1  # the arms' step-1 |delta loss| below a tenth of the control's batch-to-batch noise
WARMUP_STEPS = 3  # the first steps of a job compile and warm up: out of the tokens/s


def explained(check: dict[str, Any], losses: dict[int, float], attention: dict[str, Any] | None) -> str | None:
    """Why a resume that is not bit for bit is still exact in everything but the attention backward's last bits,
    or None: the first resumed step's loss identical (weights, optimizer, data and RNG restored), every counter
    identical, the attention backward measured not repeatable on these GPUs (the probe), and every loss
    difference below START_NOISE_FRACTION of the run's batch noise."""
    if (
        attention is None
        or attention["bitwise"]
        or not check["first_step_identical"]
        or not check["counters_identical"]
    ):
        return None
    noise = batch_noise([losses[k] for k in sorted(losses)])
    if noise is None or check["max_abs_loss_diff"] > START_NOISE_FRACTION * noise:
        return None
    return (
        "not bit for bit, explained: the first resumed step's loss is identical and every counter (LR, tokens, data) "
        "too; "
        f"later steps differ by at most {check['max_abs_loss_diff']:.2g} in loss ({check['max_rel_loss_diff']:.2g} "
        f"relative, {check['max_abs_loss_diff'] / noise:.2g} of the batch noise {noise:.3g}), because the attention "
        f"backward is not repeatable on these GPUs (stage b: two runs on the same input differ by up to "
        f"{attention['max_dq_diff']:.2g} in dq, max |dq| {attention['dq_scale']:.3g}): no two runs are bitwise "
        "equal here, resumed or not (`--debug.deterministic` asks torch for deterministic algorithms)"
    )


def pair_stage(
    arms: dict[str, dict[str, Any]], s: Any, depth: str, seconds: float, attention: dict[str, Any] | None = None
) -> Stage:
    """d: both arms trained, validated at step 0 and at the end, killed after the checkpoint, resumed bit for bit
    (or with a difference explained by the attention backward's nondeterminism), and the MHAR arm's gates moved."""
    problems, details, figures = [], [], []
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
        steps = check["steps"]
        span = f"steps {steps[0]}-{steps[-1]}" if steps else "no step"
        why = None if check["equal"] else explained(check, r["killed"]["scalars"].get("train/loss", {}), attention)
        if check["equal"]:
            figures.append(f"{arm} {span} bitwise")
        elif why:
            figures.append(f"{arm} {span} within {check['max_rel_loss_diff']:.1g} (explained)")
            details.append(f"- {arm}: {why}.")
        else:
            first = check["first_differing_step"]
            problems.append(
                f"{arm}: the resumed job differs from the killed one at step {first} ({check['differing_values']} of "
                f"{check['values']} values; largest relative loss difference {check['max_rel_loss_diff']:.3g})"
                if first is not None
                else f"{arm}: the killed job logged no step after the checkpoint"
            )
        details.append(
            f"- {arm}: first job killed (SIGKILL to the launcher's group) after step {r['killed']['killed_at']}, "
            f"the step-{s.checkpoint_at} checkpoint complete; the relaunch resumed from it and trained to step "
            f"{s.steps}; {check['values']} values ({check['tags']} tags) of {span} compared: "
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
        details.append(
            "- A resume that is not bitwise: a nondeterministic kernel or a recompile after the restart changes the "
            "numbers; rerun with `--debug.deterministic` to see whether it is the kernels, and see the arm's logs."
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
