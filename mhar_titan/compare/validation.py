"""The validation part of the paired comparison: paired CIs over the same held-out batches, MHAR - control
at every evaluation both arms ran, each arm's change from the base (step 0, before the first update), and
the check that both arms' step-0 values are identical (the same base on the same batches: MHAR at init
computes exactly the base model)."""

from __future__ import annotations

from typing import Any

from mhar_titan.compare.stats import paired_ci
from mhar_titan.components.tensorboard_scalars import set_tags

Series = dict[int, float]

VAL_TAGS = {"raw": "val/ce", "ema": "val/ce_ema"}
BASE_STEP = 0


def _agg(b: dict) -> float:
    return sum(b["ce_sum"]) / sum(b["tokens"])


def val_delta(
    ref: dict | None, new: dict | None, ref_tb: float | None, new_tb: float | None, between: str = "between the arms"
) -> dict[str, Any] | None:
    """Δ val CE = new − ref of one weight set: from the per-batch files (with the paired CI) when both have
    them, else from the TensorBoard values; None when either is missing."""
    if ref is not None and new is not None:
        out = {"delta": _agg(new) - _agg(ref), "source": "batches", "n": len(ref["tokens"]), "ci": None, "note": ""}
        if ref["tokens"] != new["tokens"]:
            out["note"] = f"per-batch token counts differ {between}: not the same batches, no CI"
            return out
        diffs = [n / t - r / t for r, n, t in zip(ref["ce_sum"], new["ce_sum"], ref["tokens"], strict=True)]
        out["ci"] = paired_ci(diffs)
        if out["ci"] is None:
            out["note"] = "fewer than 2 batches: no CI"
        return out
    if ref_tb is not None and new_tb is not None:
        return {"delta": new_tb - ref_tb, "source": "tensorboard", "n": None, "ci": None, "note": "no per-batch files"}
    return None


def _entry(scalars: dict, val: dict, step: int, kind: str) -> tuple[dict | None, float | None]:
    """One arm's per-batch record and TensorBoard value of one weight set at one step."""
    return val.get(step, {}).get(kind), scalars.get(VAL_TAGS[kind], {}).get(step)


def _val_steps(scalars: dict, val: dict) -> set[int]:
    steps = set(val)
    for tag in VAL_TAGS.values():
        steps |= set(scalars.get(tag, {}))
    return steps


def validation(cs: dict, ms: dict, cv: dict, mv: dict) -> list[dict[str, Any]]:
    """MHAR − control at every evaluation after the base both arms ran (step 0 is `base_check`'s)."""
    steps = _val_steps(cs, cv) & _val_steps(ms, mv)
    rows = []
    for s in sorted(steps - {BASE_STEP}):
        row: dict[str, Any] = {"step": s}
        for kind in VAL_TAGS:
            (c, c_tb), (m, m_tb) = _entry(cs, cv, s, kind), _entry(ms, mv, s, kind)
            row[kind] = val_delta(c, m, c_tb, m_tb)
        rows.append(row)
    return rows


def from_base(scalars: dict, val: dict) -> list[dict[str, Any]]:
    """One arm's change of val CE from step 0 at each later evaluation, paired over the same batches."""
    if BASE_STEP not in _val_steps(scalars, val):
        return []
    rows = []
    for s in sorted(_val_steps(scalars, val) - {BASE_STEP}):
        row: dict[str, Any] = {"step": s}
        for kind in VAL_TAGS:
            (b, b_tb), (v, v_tb) = _entry(scalars, val, BASE_STEP, kind), _entry(scalars, val, s, kind)
            row[kind] = val_delta(b, v, b_tb, v_tb, between=f"from step {BASE_STEP}")
        rows.append(row)
    return rows


def base_check(cs: dict, ms: dict, cv: dict, mv: dict) -> dict[str, Any]:
    """Are both arms' step-0 values identical? Per-batch CE sums and token counts bit for bit when both
    arms have the files, else the TensorBoard values. `identical` is None when an arm has no step 0."""
    present = {"control": BASE_STEP in _val_steps(cs, cv), "mhar": BASE_STEP in _val_steps(ms, mv)}
    out: dict[str, Any] = {"present": present, "identical": None}
    if not all(present.values()):
        return out
    verdicts = []
    for kind in VAL_TAGS:
        (c, c_tb), (m, m_tb) = _entry(cs, cv, BASE_STEP, kind), _entry(ms, mv, BASE_STEP, kind)
        if c is not None and m is not None:
            same, values, source = c == m, (_agg(c), _agg(m)), f"{len(c['tokens'])} batches"
        elif c_tb is not None and m_tb is not None:
            same, values, source = c_tb == m_tb, (c_tb, m_tb), "TensorBoard"
        else:
            continue
        verdicts.append(same)
        out[kind] = {
            "identical": same,
            "compared": source,
            "control": values[0],
            "mhar": values[1],
            "delta": val_delta(c, m, c_tb, m_tb),
        }
    if verdicts:
        out["identical"] = all(verdicts)
    return out


def base_warning(base: dict[str, Any], control: str, mhar: str) -> str | None:
    """A loud line for the top of the report when the arms did not start from the same validated base."""
    present = base["present"]
    if base["identical"] is False:
        kinds = ", ".join(
            f"`{VAL_TAGS[k]}` {control} {base[k]['control']:.9g}, {mhar} {base[k]['mhar']:.9g}"
            for k in VAL_TAGS
            if k in base and not base[k]["identical"]
        )
        return (
            f"**WARNING: the arms' step-0 validation differs ({kinds}).** Both arms must start from the same "
            "base, which MHAR at init computes exactly: a different base, tokenizer or validation data. "
            "The arms are not a matched pair; read every delta below with that in mind."
        )
    if present["control"] != present["mhar"]:
        have, lack = (control, mhar) if present["control"] else (mhar, control)
        return (
            f"**WARNING: only `{have}` validated the base at step 0; `{lack}` did not** "
            "(validation.at_start off, or a run from before it): the common base is not checked."
        )
    return None


def _ci_text(p: dict[str, Any]) -> tuple[str, str]:
    ci = p["ci"]
    if ci is None:
        return "n/a", "n/a"
    return f"{ci['mean']:+.3e}", f"[{ci['low']:+.3e}, {ci['high']:+.3e}] (±{ci['half_width']:.2e})"


def report_lines(r: dict[str, Any], control: str, mhar: str) -> list[str]:
    """The report's "Validation" section: the base, each arm's change from it, and MHAR − control."""
    lines = ["## Validation", ""]
    lines += _base_lines(r["base"], control, mhar)
    lines += _from_base_lines(r["from_base"], control, mhar)
    lines += _between_arms_lines(r["val"], r["from_base"], control, mhar)
    return lines


def _base_lines(base: dict[str, Any], control: str, mhar: str) -> list[str]:
    """The "base (step 0)" subsection: identical, differing (with a table), or not validated in both arms."""
    lines = ["### The base (step 0)", ""]
    if base["identical"] is True:
        values = "; ".join(
            f"`{VAL_TAGS[k]}` {base[k]['control']:.6f}, compared over {base[k]['compared']}"
            for k in VAL_TAGS
            if k in base
        )
        lines.append(f"Both arms' step-0 values are identical ({values}): the same base on the same held-out data.")
    elif base["identical"] is False:
        lines += [base_warning(base, control, mhar) or "", ""]
        lines += [f"| weights | {control} | {mhar} | Δ | 95% CI |", "|---|---:|---:|---:|---|"]
        for k in VAL_TAGS:
            if k in base:
                b = base[k]
                ci = _ci_text(b["delta"])[1] if b["delta"] else "n/a"
                delta = b["mhar"] - b["control"]
                lines.append(f"| `{VAL_TAGS[k]}` | {b['control']:.6f} | {b['mhar']:.6f} | {delta:+.3e} | {ci} |")
    elif any(base["present"].values()):
        lines.append(base_warning(base, control, mhar) or "")
    else:
        lines.append(
            "No step-0 validation in either arm (validation.at_start off, or runs from before it): "
            "no change from the base."
        )
    lines.append("")
    return lines


def _from_base_row(row: dict[str, Any]) -> str:
    """One table row of an arm's change from the base: raw and EMA deltas with CIs, batches, distinct notes."""
    cells, notes, n = [], [], None
    for kind in VAL_TAGS:
        p = row[kind]
        cells += [f"{p['delta']:+.3e}", _ci_text(p)[1]] if p else ["n/a", "n/a"]
        if p:
            n = n or p["n"]
            if p["note"] and p["note"] not in notes:
                notes.append(p["note"])
    return f"| {row['step']} | {' | '.join(cells)} | {n or 'n/a'} | {'; '.join(notes)} |"


def _from_base_lines(changes: dict[str, list[dict[str, Any]]], control: str, mhar: str) -> list[str]:
    """One table per arm of its change from the base, then what Δ from the base means."""
    lines: list[str] = []
    for role, name in (("control", control), ("mhar", mhar)):
        rows = changes[role]
        if not rows:
            continue
        lines += [
            f"### Change of `{name}` from the base",
            "",
            "| step | Δ val CE | 95% CI | Δ val CE (EMA) | 95% CI (EMA) | batches | note |",
            "|---:|---:|---|---:|---|---:|---|",
        ]
        lines += [_from_base_row(row) for row in rows]
        lines.append("")
    if any(changes.values()):
        lines += [
            "Δ from the base = the arm's val CE at the step − its val CE at step 0 (negative: better than the base), "
            "paired over the same batches as below.",
            "",
        ]
    return lines


def _between_arms_lines(
    val: list[dict[str, Any]], changes: dict[str, list[dict[str, Any]]], control: str, mhar: str
) -> list[str]:
    """MHAR − control per weight set at each evaluation after the base, and how the CI is computed."""
    lines: list[str] = []
    if not val:
        lines += [f"No evaluation after step {BASE_STEP} in both arms.", ""]
    for kind, title in (("raw", "raw weights (`val/ce`)"), ("ema", "EMA weights (`val/ce_ema`)")):
        rows = [(v["step"], v[kind]) for v in val if v[kind]]
        if not rows:
            continue
        lines += [
            f"### `{mhar}` − `{control}`, {title}",
            "",
            "| step | Δ val CE | mean per-batch Δ | 95% CI | batches | note |",
            "|---:|---:|---:|---|---:|---|",
        ]
        for step, p in rows:
            mean, span = _ci_text(p)
            lines.append(f"| {step} | {p['delta']:+.3e} | {mean} | {span} | {p['n'] or 'n/a'} | {p['note']} |")
        lines.append("")
    if val or any(changes.values()):
        lines += [
            "Δ val CE is token-weighted over all batches (as `val/ce`); the CI is paired over the same batches: "
            "mean of the per-batch CE differences ± t(0.975, n−1)·sd/√n.",
            "",
        ]
        if any(v["raw"] or v["ema"] for v in val):
            lines += ["![validation deltas](val_delta.png)", ""]
    return lines


def _set_names(scalars: dict, val: dict) -> list[str]:
    names: list[str] = []
    for record in val.values():
        names += [n for n in record.get("sets", {}) if n not in names]
    for tag in sorted(scalars):
        parts = tag.split("/")
        if len(parts) == 3 and parts[0] == "val" and parts[2] == "ce" and parts[1] not in names:
            names.append(parts[1])
    return names


def named_sets(cs: dict, ms: dict, cv: dict, mv: dict) -> list[dict[str, Any]]:
    """Per named validation set (`[data] validation_sets`) both arms logged: each arm's CE, raw and EMA,
    at every evaluation both ran, and MHAR − control with the paired CI over the set's batches."""
    names = [n for n in _set_names(cs, cv) if n in _set_names(ms, mv)]
    out = []
    for name in names:
        tags = set_tags(name)
        rows = []
        for step in sorted(_set_steps(cs, cv, name) & _set_steps(ms, mv, name)):
            row: dict[str, Any] = {"step": step}
            for kind in VAL_TAGS:
                (c, c_tb), (m, m_tb) = _set_entry(cs, cv, name, step, kind), _set_entry(ms, mv, name, step, kind)
                control = _agg(c) if c is not None else c_tb
                mhar = _agg(m) if m is not None else m_tb
                row[kind] = {"control": control, "mhar": mhar, "delta": val_delta(c, m, c_tb, m_tb)}
            rows.append(row)
        out.append({"name": name, "tags": tags, "rows": rows})
    return out


def _set_entry(scalars: dict, val: dict, name: str, step: int, kind: str) -> tuple[dict | None, float | None]:
    return val.get(step, {}).get("sets", {}).get(name, {}).get(kind), scalars.get(set_tags(name)[kind], {}).get(step)


def _set_steps(scalars: dict, val: dict, name: str) -> set[int]:
    return {s for s, rec in val.items() if name in rec.get("sets", {})} | set(scalars.get(set_tags(name)["raw"], {}))


def named_set_lines(sets: list[dict[str, Any]], control: str, mhar: str) -> list[str]:
    """The report's "Validation sets" section: one table per named set."""
    if not sets:
        return []
    lines = [
        "## Validation sets",
        "",
        f"Each named set's cross-entropy (token-weighted over all its batches), `{control}` and `{mhar}`, and "
        f"`{mhar}` − `{control}` with the paired 95% CI over the set's batches; step 0 is the base.",
        "",
    ]
    for vset in sets:
        lines += [
            f"### `{vset['name']}` (`{vset['tags']['raw']}`, `{vset['tags']['ema']}`)",
            "",
            f"| step | {control} | {mhar} | Δ | 95% CI | {control} (EMA) | {mhar} (EMA) | Δ (EMA) | 95% CI (EMA) |",
            "|---:|---:|---:|---:|---|---:|---:|---:|---|",
        ]
        for row in vset["rows"]:
            cells = []
            for kind in VAL_TAGS:
                p = row[kind]
                d = p["delta"]
                cells += [_f6(p["control"]), _f6(p["mhar"])]
                cells += [f"{d['delta']:+.3e}", _ci_text(d)[1]] if d else ["n/a", "n/a"]
            lines.append(f"| {row['step']} | {' | '.join(cells)} |")
        lines.append("")
    return lines


def _f6(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.6f}"


def summary_lines(r: dict[str, Any]) -> list[str]:
    lines = []
    base = r["base"]
    if base["identical"] is not None or any(base["present"].values()):
        verdict = {True: "identical", False: "DIFFER (not a matched pair)", None: "not in both arms"}
        lines.append(f"step-0 validation (the base): {verdict[base['identical']]}")
    for role, rows in r["from_base"].items():
        if rows:
            last = rows[-1]
            parts = [f"{kind} {last[kind]['delta']:+.3e}" for kind in VAL_TAGS if last[kind]]
            lines.append(f"{role} change from the base at step {last['step']}: " + ", ".join(parts))
    if r["val"]:
        v = r["val"][-1]
        for kind in VAL_TAGS:
            if v[kind]:
                ci = v[kind]["ci"]
                ci_text = f" (95% CI [{ci['low']:+.2e}, {ci['high']:+.2e}])" if ci else ""
                lines.append(f"val {kind} at step {v['step']}: Δ {v[kind]['delta']:+.3e}{ci_text}")
    return lines
