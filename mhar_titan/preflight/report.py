"""runs/preflight/<timestamp>/report.md: what ran where, the table, each stage's details and what to do about a FAIL."""

from __future__ import annotations

import shlex
import time
from typing import Any

from mhar_titan.preflight.stages import markdown_table

WHAT_TO_DO = {
    "a": "install a torch, triton and torchtitan within the pins (docs/install.md); give every rank the same versions "
    "and GPU model",
    "b": "the fused routing kernels are wrong or not repeatable on this stack: run "
    "`pytest tests/test_routing_triton.py` here and use `--mhar.backend torch` until they pass",
    "c": "a rank off the median: drain or replace that GPU or node (one slow rank sets the pace of every step)",
    "d": "read the arm's logs under logs/; a resume that is not bitwise means the run cannot be resumed exactly here",
    "e": "plan the real job with `python -m mhar_titan.plan` and a larger margin, or lighter activation checkpointing",
    "f": "both arms must load the same base: check `model.hf_assets_path` and the tokenizer in both configs",
    "g": "the exports are not read as the trained model: do not evaluate them; see logs/exports-<arm>.log",
    "h": "see logs/evaluate.log; a task whose dataset is not cached must be cached first (docs/pair.md)",
    "i": "the arms did not see the same schedule or data: the configs differ outside [mhar]",
}


def report_markdown(pf: Any, argv: list[str], seconds: float, host: str) -> str:
    bad = [s for s in pf.stages if not s.ok]
    lines = [
        f"# Preflight {pf.root.name}: {'PASS' if not bad else 'FAIL'}",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; host {host}; {pf.nproc} "
        f"{'GPU' if pf.cuda else 'CPU'} ranks; {seconds / 60:.1f} min",
        f"- command: `python -m mhar_titan.preflight {shlex.join(argv)}`",
        f"- base: {pf.base.reason}",
        f"- depth: {pf.layers} of {pf.full} layers"
        + (
            f" (the plan fits at most {pf.plan_info.get('deepest')} here)"
            if getattr(pf, "plan_info", {}).get("planned")
            else ""
        ),
        f"- the pair: each arm {pf.args.steps} steps of one microbatch a rank (global batch = local batch x ranks), "
        f"checkpoint at step {pf.args.steps // 2}, validation at step 0, at the kill step and at the end, logged every "
        "step; the killed arm relaunched twice from the checkpoint (a rerun killed at the same step, then the resumed "
        "job); every other setting is the configs' (width, sequence length, microbatch, activation checkpointing, "
        "compile, converters)",
        "",
        *markdown_table(pf.stages),
        "",
    ]
    for s in pf.stages:
        lines += [f"## {s.key}. {s.name}: {s.result}", "", s.figure, ""]
        lines += s.details
        if not s.ok and s.key in WHAT_TO_DO:
            lines += ["", f"What to do: {WHAT_TO_DO[s.key]}."]
        lines.append("")
    lines += [
        "Files: `probe/` (each rank's environment, kernel and hardware figures), `logs/` (every job's log), "
        "`pair/` (both arms' run folders: TensorBoard, validation; `pair/compare/report.md` is the paired report).",
        "",
    ]
    return "\n".join(lines)
