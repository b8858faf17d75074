"""Evaluate both arms of a pair with lm-evaluation-harness, as the field evaluates mid-training runs, and
report the paired differences.

Each arm's checkpoint at the same step (raw weights and EMA) is exported as an HF model (the MHAR arm
with its modeling code, loaded with trust_remote_code) and run through `lm_eval.simple_evaluate` with
the same tasks and settings. Per task and metric the table gives each arm's score with lm-eval's
stderr, and the MHAR - control delta with a paired stderr and 95% CI over the same documents. It goes
to `<pair>/compare/eval.md` and `eval.json`, into `report.md` (its "Evaluation" section), and to
TensorBoard (`<pair>/eval`: `eval/<weights>/<task>/<metric>/{control,mhar,delta}` at the step).

    python -m mhar_titan.eval runs/<pair> --tasks mhar_tiny_cloze [--step N] [--weights raw,ema] [--limit N]
    python -m mhar_titan.eval runs/<pair> --tasks hellaswag,arc_easy,piqa --device cuda --dtype bf16

This module evaluates one step (the command's default form; cli.py parses the command line); watch.py
evaluates every kept step as the pair runs, through the same export, harness and pairing.

Offline: HF_DATASETS_OFFLINE is set (by __main__.py, before datasets is imported), so standard tasks need
their datasets in the HF cache. Every task is resolved and its dataset loaded before anything is exported
(harness.py): an unknown task, or a dataset not cached, is refused in one line (exit 2) with nothing exported.
The `mhar_tiny_cloze` task (mhar_titan/eval/tasks.py) is built from the demo corpus and needs nothing.
Exports are scratch folders (`<pair>/eval/<arm>-<weights>-step-N`), removed whatever happens (an error,
Ctrl-C) unless --keep-exports. Needs the `eval` extra: pip install -e '.[eval]'.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import statistics
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter

from data.atomic import write_text
from mhar_titan.compare.stats import paired_ci
from mhar_titan.components.checkpoint.layout import FOLDER, complete_steps
from mhar_titan.eval.harness import Tasks, load_tasks, one_line, run_harness
from mhar_titan.eval.steps import ARMS, read_arm
from mhar_titan.eval.suites import requested
from mhar_titan.eval.tasks import write_task
from mhar_titan.hf.files import DTYPES
from mhar_titan.hf.run import export_run, run_model_args

REPORT_START, REPORT_END = "<!-- eval: start -->", "<!-- eval: end -->"


def common_step(pair: Path, step: int | None) -> int:
    """The newest step both arms have a complete checkpoint for (or `step`, checked)."""
    have = [set(complete_steps(str(pair / arm / FOLDER))) for arm in ARMS]
    both = sorted(have[0] & have[1])
    if step is not None:
        if step not in both:
            raise ValueError(f"{pair}: step {step} is not a complete checkpoint of both arms (both have {both})")
        return step
    if not both:
        raise ValueError(
            f"{pair}: no step with a complete checkpoint in both arms ({ARMS[0]}: {sorted(have[0])}, "
            f"{ARMS[1]}: {sorted(have[1])})"
        )
    return both[-1]


def export_arm(pair: Path, arm: str, step: int, ema: bool, out: Path, dtype: str) -> Path:
    """The arm's weights at `step` as an HF folder (replaced if it exists), with the base's tokenizer."""
    run = pair / arm
    args, base = run_model_args(str(run))
    if not base or not (Path(base) / "tokenizer.json").is_file():
        raise ValueError(f"{run}: its base {base!r} has no tokenizer.json to export with the model")
    shutil.rmtree(out, ignore_errors=True)
    export_run(str(run), str(out), step=step, ema=ema, dtype=DTYPES[dtype], log=lambda line: print(f"{arm}: {line}"))
    model_type = json.loads((out / "config.json").read_text()).get("model_type")
    if args.mhar.enable and model_type == "llama":  # transformers would drop the routing, silently
        raise ValueError(f"{out}: the MHAR arm exported as model_type 'llama'; transformers would drop its routing")
    return out


class EvalFailed(RuntimeError):
    """An evaluation that failed after the task check: one line naming the arm, weights, step and tasks."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during an evaluation, naming where (still a KeyboardInterrupt for callers)."""


@contextlib.contextmanager
def exported(
    pair: Path, arm: str, step: int, weights: str, folder: Path, dtype: str, keep: bool = False
) -> Iterator[Path]:
    """The arm's `weights` at `step` exported to the scratch `folder` for the body of the `with`; the folder is
    removed whatever happens (an error, Ctrl-C, a stop signal raised as an exception), kept only with `keep`
    after a body that finished."""
    done = False
    try:
        export_arm(pair, arm, step, weights == "ema", folder, dtype)
        yield folder
        done = True
    finally:
        if not (done and keep):
            shutil.rmtree(folder, ignore_errors=True)
            with contextlib.suppress(OSError):  # its parent too, if that left it empty
                folder.parent.rmdir()


def evaluate_arm(pair: Path, arm: str, step: int, weights: str, tasks: Tasks, args: argparse.Namespace) -> dict:
    """One arm exported to its scratch folder and run through lm-eval; the folder is removed whatever happens
    (an error, Ctrl-C), kept only with --keep-exports and a finished evaluation."""
    folder = pair / "eval" / f"{arm}-{weights}-step-{step}"
    with exported(pair, arm, step, weights, folder, args.dtype, args.keep_exports):
        return run_harness(folder, tasks, args)


def paired_rows(control: dict[str, Any], mhar: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per task and metric: both arms' scores and stderrs, the delta with its paired stderr and CI.

    Documents pair by task, doc_id and lm-eval filter (gsm8k scores each document under two filters); a group's
    are its members' (lm-eval's group_subtasks). The paired stderr and CI are given where the metric is the mean
    of its per-document values (the delta equals the mean paired difference), not for a corpus-level metric or a
    group averaged over its members unweighted.
    """
    rows = []
    for task in sorted(control["results"]):
        c_res, m_res = control["results"][task], mhar["results"].get(task, {})
        c_docs, m_docs = _documents(control, task), _documents(mhar, task)
        if c_docs.keys() != m_docs.keys() or any(
            c_docs[k].get("doc_hash") != m_docs[k].get("doc_hash") for k in c_docs
        ):
            raise ValueError(f"{task}: the arms were evaluated on different documents")
        for key, value in sorted(c_res.items()):
            if not isinstance(value, (int, float)) or "_stderr" in key or "," not in key or key not in m_res:
                continue
            stderr_key = key.replace(",", "_stderr,", 1)
            delta = float(m_res[key]) - float(value)
            diffs = _differences(c_docs, m_docs, key, delta)
            ci = paired_ci(diffs) if len(diffs) > 1 else None
            rows.append(
                {
                    "task": task,
                    "metric": key,
                    "control": float(value),
                    "control_stderr": _num(c_res.get(stderr_key)),
                    "mhar": float(m_res[key]),
                    "mhar_stderr": _num(m_res.get(stderr_key)),
                    "delta": delta,
                    "delta_stderr": statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None,
                    "delta_ci": [ci["low"], ci["high"]] if ci else None,
                    "n": len(diffs),
                }
            )
    return rows


def _documents(scores: dict[str, Any], task: str) -> dict[tuple, dict[str, Any]]:
    """{(task, doc_id, filter): sample} of `task`'s documents; a group's pooled from its members, recursively."""
    out = {}
    for member in _members(scores.get("group_subtasks") or {}, task, set()):
        for sample in scores["samples"].get(member, []):
            out[(member, sample["doc_id"], sample.get("filter", "none"))] = sample
    return out


def _members(groups: dict[str, list[str]], task: str, seen: set[str]) -> list[str]:
    if not groups.get(task) or task in seen:
        return [task]
    seen.add(task)
    return [leaf for sub in groups[task] for leaf in _members(groups, sub, seen)]


def _differences(c_docs: dict[tuple, dict], m_docs: dict[tuple, dict], key: str, delta: float) -> list[float]:
    """The per-document MHAR - control values of metric `key` ("metric,filter"), or [] when their mean is not the
    delta (a corpus-level metric, an unweighted group mean): no paired CI is better than a wrong one."""
    metric, kept = key.split(",", 1)
    diffs = []
    for k in sorted(c_docs):
        c, m = c_docs[k].get(metric), m_docs[k].get(metric)
        if k[2] == kept and isinstance(c, (int, float)) and isinstance(m, (int, float)):
            diffs.append(float(m) - float(c))
    if not diffs or not math.isclose(statistics.fmean(diffs), delta, rel_tol=1e-9, abs_tol=1e-9):
        return []
    return diffs


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def fmt(x: float | None, spec: str = ".4f") -> str:
    """A table cell: the number, or - for none."""
    return "-" if x is None else format(x, spec)


def table(results: dict[str, list[dict[str, Any]]], step: int, tasks: list[str]) -> str:
    lines = [
        REPORT_START,
        "## Evaluation (lm-evaluation-harness)",
        "",
        f"Both arms at step {step}, tasks {', '.join(tasks)}, the same settings; delta = MHAR - control with a "
        "paired stderr and 95% CI over the same documents.",
        "",
    ]
    return "\n".join([*lines, *table_rows(results), REPORT_END, ""])


def table_rows(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The paired table's markdown lines, one table per weights (the report's section without its heading)."""
    lines = []
    for weights, rows in results.items():
        lines += [f"**{weights} weights**", "", "| task | metric | control | mhar | delta | stderr | 95% CI | n |"]
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in rows:
            ci = f"[{r['delta_ci'][0]:+.4f}, {r['delta_ci'][1]:+.4f}]" if r["delta_ci"] else "-"
            metric = r["metric"].removesuffix(",none")  # lm-eval's default filter
            lines.append(
                f"| {r['task']} | {metric} | {fmt(r['control'])} ± {fmt(r['control_stderr'])} | "
                f"{fmt(r['mhar'])} ± {fmt(r['mhar_stderr'])} | {r['delta']:+.4f} | {fmt(r['delta_stderr'])} | {ci} | "
                f"{r['n']} |"
            )
        lines.append("")
    return lines


def write_outputs(pair: Path, out: Path, step: int, tasks: list[str], results: dict[str, list[dict]]) -> str:
    """eval.json, eval.md, the report's section (replaced, not appended twice) and the TensorBoard run."""
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "eval.json", json.dumps({"step": step, "tasks": tasks, "results": results}, indent=2))
    text = table(results, step, tasks)
    write_section(out, text)
    write_scalars(pair / "eval", {step: results})
    return text


def write_section(out: Path, text: str) -> None:
    """eval.md (which `python -m mhar_titan.compare` appends to the report it rewrites) and the report's
    Evaluation section between REPORT_START and REPORT_END, replaced where it is, never appended twice."""
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "eval.md", text)
    report = out / "report.md"
    old = report.read_text() if report.exists() else ""
    if REPORT_START in old and REPORT_END in old:
        old = old[: old.index(REPORT_START)] + old[old.index(REPORT_END) + len(REPORT_END) :].lstrip("\n")
    write_text(report, old.rstrip("\n") + ("\n\n" if old.strip() else "") + text)


def write_scalars(folder: Path, by_step: dict[int, dict[str, list[dict[str, Any]]]]) -> None:
    """The paired rows as TensorBoard scalars at their steps: eval/<weights>/<task>/<metric>/{control,mhar,delta}."""
    writer = SummaryWriter(str(folder))
    for step, results in sorted(by_step.items()):
        for weights, rows in results.items():
            for r in rows:
                tag = f"eval/{weights}/{r['task']}/{r['metric'].replace(',', '_')}"
                for arm in ("control", "mhar", "delta"):
                    writer.add_scalar(f"{tag}/{arm}", r[arm], step)
    writer.close()


def evaluate_pair(pair: Path, args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Both arms on the same tasks, paired; every refusal (run folders, step, weights, tasks and their datasets)
    comes before the first export, and a later failure names the arm, weights, step and tasks."""
    for arm in ARMS:
        read_arm(pair, arm)
    confirm = getattr(args, "confirm_run_unsafe_code", False)
    request = requested(getattr(args, "tasks", None), getattr(args, "suite", None), args.num_fewshot, confirm)
    every_weights = weights_of(args.weights)
    step = common_step(pair, args.step)
    left = "" if args.keep_exports else f" (scratch exports removed from {pair / 'eval'})"

    def score(arm: str, weights: str, built: Tasks) -> dict[str, Any]:
        return evaluate_arm(pair, arm, step, weights, built, args)

    results = evaluate_models(
        request.names, every_weights, step, score, "export and ", left, request.shots, confirm_unsafe=confirm
    )
    print(write_outputs(pair, Path(args.out) if args.out else pair / "compare", step, request.names, results))
    return results


def weights_of(text: str) -> list[str]:
    """--weights as a list: raw, ema or both."""
    every_weights = [w for w in text.split(",") if w]
    if not every_weights or any(w not in ("raw", "ema") for w in every_weights):
        raise ValueError(f"--weights {text!r}: expected raw, ema or raw,ema")
    return every_weights


def evaluate_models(
    tasks: list[str],
    every_weights: list[str],
    step: int,
    score: Callable[[str, str, Tasks], dict[str, Any]],
    doing: str = "",
    left: str = "",
    shots: dict[str, int] | None = None,
    confirm_unsafe: bool = False,
) -> dict[str, list[dict[str, Any]]]:
    """Every arm with every weights scored by `score(arm, weights, built_tasks)` (an export and lm-eval, or lm-eval
    on a folder already exported) on the same tasks, built once before the first score; paired per weights.
    A failure names the arm, weights, step and tasks (and `left`: what was cleaned up). `shots`: a suite's."""
    # Our task's files live for this call only (lm-eval reads them when it builds the task, below), so a
    # refused command leaves nothing behind.
    with tempfile.TemporaryDirectory(prefix="mhar_titan_eval_tasks_") as task_dir:
        # before any export: an 8B export takes minutes
        built = load_tasks(tasks, write_task(Path(task_dir)), shots, confirm_unsafe)
        results = {}
        for weights in every_weights:
            scores = {}
            for arm in ARMS:
                where = f"{arm} arm, {weights} weights, step {step}, tasks {','.join(tasks)}"
                print(f"[eval] {arm}, {weights} weights, step {step}: {doing}{', '.join(tasks)}", flush=True)
                try:
                    scores[arm] = score(arm, weights, built)
                except Exception as e:
                    raise EvalFailed(f"{where}: {one_line(e)}{left}") from e
                except KeyboardInterrupt as e:
                    raise Interrupted(f"{where}: interrupted") from e
            results[weights] = paired_rows(scores["control"], scores["mhar"])
    return results
