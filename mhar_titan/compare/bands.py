"""Where MHAR helps: the paired validation delta of every set by a token's position in its document and by its
document's length (components/val_bands.py), with a 95% CI over the same batches, at the last evaluation both arms
recorded by band. Reading the depth history should matter most late in long documents; this says whether it does."""

from __future__ import annotations

from typing import Any

from mhar_titan.compare.validation import val_delta
from mhar_titan.components.val_bands import BANDS

KINDS = {"position": "position in the document", "doc_length": "document length"}


def _sets(record: dict[str, Any], weights: str) -> dict[str, dict[str, Any]]:
    """{set: its bands} of one weight set's record."""
    sets = record.get("sets", {})
    return {name: e[weights]["bands"] for name, e in sets.items() if "bands" in e.get(weights, {})}


def summary(cv: dict[int, dict], mv: dict[int, dict], weights: str = "raw") -> dict[str, Any] | None:
    """{step, sets: {set: {band kind: [{band, tokens, delta, ci, note}]}}} at the last step both arms recorded bands
    for; None where none did."""
    steps = [s for s in sorted(set(cv) & set(mv)) if s > 0 and _sets(cv[s], weights) and _sets(mv[s], weights)]
    if not steps:
        return None
    step = steps[-1]
    ours, theirs = _sets(cv[step], weights), _sets(mv[step], weights)
    out: dict[str, Any] = {"step": step, "weights": weights, "sets": {}}
    for name in sorted(set(ours) & set(theirs)):
        out["sets"][name] = {}
        for kind, bands in BANDS.items():
            rows = []
            for band in bands:
                c, m = ours[name][kind][band], theirs[name][kind][band]
                keep = [i for i, t in enumerate(c["tokens"]) if t > 0]
                if not keep:
                    continue
                ref = {key: [c[key][i] for i in keep] for key in ("ce_sum", "tokens")}
                new = {key: [m[key][i] for i in keep] for key in ("ce_sum", "tokens")}
                rows.append({"band": band, "tokens": sum(ref["tokens"]), **(val_delta(ref, new, None, None) or {})})
            out["sets"][name][kind] = rows
    return out


def _verdict(row: dict[str, Any]) -> str:
    ci = row.get("ci")
    if ci is None:
        return "no CI"
    if ci["high"] < 0:
        return "MHAR lower"
    if ci["low"] > 0:
        return "MHAR higher"
    return "within noise"


def report_lines(s: dict[str, Any] | None, control: str, mhar: str) -> list[str]:
    if s is None:
        return []
    lines = [
        "## Where MHAR helps",
        "",
        f"Validation CE, {mhar} - {control}, by band, at step {s['step']} ({s['weights']} weights), over the same "
        "batches (95% CI of the per-batch mean difference; batches without a token in the band left out). "
        "`unknown`: tokens of a document begun before the window; `cut`: documents not wholly in the window.",
        "",
    ]
    for name, kinds in s["sets"].items():
        for kind, rows in kinds.items():
            lines += [f"Set `{name}`, by {KINDS[kind]}:", "", "| band | tokens | Δ CE | 95% CI | |"]
            lines.append("|---|---:|---:|---|---|")
            for row in rows:
                ci = row.get("ci")
                ci_text = f"[{ci['low']:+.3e}, {ci['high']:+.3e}]" if ci else row.get("note", "") or "n/a"
                delta = f"{row['delta']:+.3e}"
                lines.append(f"| {row['band']} | {row['tokens']:,} | {delta} | {ci_text} | {_verdict(row)} |")
            lines.append("")
    return lines
