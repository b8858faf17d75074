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
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter

from mhar_titan.compare.stats import paired_ci
from mhar_titan.components.checkpoint import complete_steps
from mhar_titan.eval.harness import TaskRefused, Tasks, load_tasks, one_line, run_harness
from mhar_titan.eval.tasks import write_task
from mhar_titan.hf.files import DTYPES
from mhar_titan.hf.run import export_run, run_model_args

ARMS = ("control", "mhar")
REPORT_START, REPORT_END = "<!-- eval: start -->", "<!-- eval: end -->"


def common_step(pair: Path, step: int | None) -> int:
    """The newest step both arms have a complete checkpoint for (or `step`, checked)."""
    have = [set(complete_steps(str(pair / arm / "checkpoint"))) for arm in ARMS]
    both = sorted(have[0] & have[1])
    if step is not None:
        if step not in both:
            raise ValueError(f"{pair}: step {step} is not a complete checkpoint of both arms (both have {both})")
        return step
    if not both:
        raise ValueError(f"{pair}: no step with a complete checkpoint in both arms ({ARMS[0]}: {sorted(have[0])}, "
                         f"{ARMS[1]}: {sorted(have[1])})")  # fmt: skip
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


def evaluate_arm(pair: Path, arm: str, step: int, weights: str, tasks: Tasks, args: argparse.Namespace) -> dict:
    """One arm exported to its scratch folder and run through lm-eval; the folder is removed whatever happens
    (an error, Ctrl-C), kept only with --keep-exports and a finished evaluation."""
    folder = pair / "eval" / f"{arm}-{weights}-step-{step}"
    done = False
    try:
        export_arm(pair, arm, step, weights == "ema", folder, args.dtype)
        scores = run_harness(folder, tasks, args)
        done = True
        return scores
    finally:
        if not (done and args.keep_exports):
            shutil.rmtree(folder, ignore_errors=True)
            with contextlib.suppress(OSError):  # <pair>/eval too, if that left it empty
                folder.parent.rmdir()


def paired_rows(control: dict[str, Any], mhar: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per task and metric: both arms' scores and stderrs, the delta with its paired stderr and CI."""
    rows = []
    for task in sorted(control["results"]):
        c_res, m_res = control["results"][task], mhar["results"].get(task, {})
        c_docs = {s["doc_id"]: s for s in control["samples"].get(task, [])}
        m_docs = {s["doc_id"]: s for s in mhar["samples"].get(task, [])}
        if c_docs.keys() != m_docs.keys():
            raise ValueError(f"{task}: the arms were evaluated on different documents")
        for key, value in sorted(c_res.items()):
            if not isinstance(value, (int, float)) or "_stderr" in key or "," not in key or key not in m_res:
                continue
            metric = key.split(",")[0]
            diffs = [float(m_docs[d][metric]) - float(c_docs[d][metric]) for d in sorted(c_docs) if metric in c_docs[d]]
            ci = paired_ci(diffs) if len(diffs) > 1 else None
            stderr_key = key.replace(",", "_stderr,", 1)
            rows.append(
                {
                    "task": task,
                    "metric": key,
                    "control": float(value),
                    "control_stderr": _num(c_res.get(stderr_key)),
                    "mhar": float(m_res[key]),
                    "mhar_stderr": _num(m_res.get(stderr_key)),
                    "delta": float(m_res[key]) - float(value),
                    "delta_stderr": statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None,
                    "delta_ci": [ci["low"], ci["high"]] if ci else None,
                    "n": len(diffs),
                }
            )
    return rows


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _f(x: float | None, fmt: str = ".4f") -> str:
    return "-" if x is None else format(x, fmt)


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
                f"| {r['task']} | {metric} | {_f(r['control'])} ± {_f(r['control_stderr'])} | "
                f"{_f(r['mhar'])} ± {_f(r['mhar_stderr'])} | {r['delta']:+.4f} | {_f(r['delta_stderr'])} | {ci} | "
                f"{r['n']} |"
            )
        lines.append("")
    return lines


def write_outputs(pair: Path, out: Path, step: int, tasks: list[str], results: dict[str, list[dict]]) -> str:
    """eval.json, eval.md, the report's section (replaced, not appended twice) and the TensorBoard run."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps({"step": step, "tasks": tasks, "results": results}, indent=2))
    text = table(results, step, tasks)
    (out / "eval.md").write_text(text)
    report = out / "report.md"
    old = report.read_text() if report.exists() else ""
    if REPORT_START in old and REPORT_END in old:
        old = old[: old.index(REPORT_START)] + old[old.index(REPORT_END) + len(REPORT_END) :].lstrip("\n")
    report.write_text(old.rstrip("\n") + ("\n\n" if old.strip() else "") + text)
    writer = SummaryWriter(str(pair / "eval"))
    for weights, rows in results.items():
        for r in rows:
            tag = f"eval/{weights}/{r['task']}/{r['metric'].replace(',', '_')}"
            for arm in ("control", "mhar", "delta"):
                writer.add_scalar(f"{tag}/{arm}", r[arm], step)
    writer.close()
    return text


def evaluate_pair(pair: Path, args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Both arms on the same tasks, paired; every refusal (run folders, step, weights, tasks and their datasets)
    comes before the first export, and a later failure names the arm, weights, step and tasks."""
    for arm in ARMS:
        if not (pair / arm / "model_args.json").is_file():
            raise ValueError(
                f"{pair / arm}: not a run of train_cpt.py (no model_args.json); expected {pair}/{{control,mhar}}"
            )
    step = common_step(pair, args.step)
    tasks = [t for t in args.tasks.split(",") if t]
    every_weights = [w for w in args.weights.split(",") if w]
    if not every_weights or any(w not in ("raw", "ema") for w in every_weights):
        raise ValueError(f"--weights {args.weights!r}: expected raw, ema or raw,ema")
    left = "" if args.keep_exports else f" (scratch exports removed from {pair / 'eval'})"

    def score(arm: str, weights: str, built: Tasks) -> dict[str, Any]:
        return evaluate_arm(pair, arm, step, weights, built, args)

    results = evaluate_models(tasks, every_weights, step, score, doing="export and ", left=left)
    print(write_outputs(pair, Path(args.out) if args.out else pair / "compare", step, tasks, results))
    return results


def evaluate_models(
    tasks: list[str],
    every_weights: list[str],
    step: int,
    score: Callable[[str, str, Tasks], dict[str, Any]],
    doing: str = "",
    left: str = "",
) -> dict[str, list[dict[str, Any]]]:
    """Every arm with every weights scored by `score(arm, weights, built_tasks)` (an export and lm-eval, or lm-eval
    on a folder already exported) on the same tasks, built once before the first score; paired per weights.
    A failure names the arm, weights, step and tasks (and `left`: what was cleaned up)."""
    # Our task's files live for this call only (lm-eval reads them when it builds the task, below), so a
    # refused command leaves nothing behind.
    with tempfile.TemporaryDirectory(prefix="mhar_titan_eval_tasks_") as task_dir:
        built = load_tasks(tasks, write_task(Path(task_dir)))  # before any export: an 8B export takes minutes
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m mhar_titan.eval", description=__doc__.split("\n\n")[0].replace("\n", " ")
    )
    parser.add_argument("pair", help="the pair's folder: runs/NAME with control/ and mhar/")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval tasks (mhar_tiny_cloze: offline demo)")
    parser.add_argument("--step", type=int, default=None, help="default: the newest step both arms have")
    parser.add_argument("--weights", default="raw,ema", help="raw, ema or raw,ema")
    parser.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    parser.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: each task's own)")
    parser.add_argument("--batch-size", default="8", help="lm-eval batch size: a number or auto (default 8)")
    parser.add_argument("--device", default="cpu", help="where the exported models run: cpu, cuda (default cpu)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="the models' dtype")
    parser.add_argument("--out", default=None, help="default: <pair>/compare")
    parser.add_argument(
        "--keep-exports",
        action="store_true",
        help="keep <pair>/eval/<arm>-<weights>-step-N once evaluated (removed otherwise, also on errors)",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # for what imports datasets later (__main__.py sets it first)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        evaluate_pair(Path(args.pair), args)
    except TaskRefused as e:  # nothing exported: as a usage error
        print(f"python -m mhar_titan.eval: {e}", file=sys.stderr)
        sys.exit(2)
    except (ValueError, FileNotFoundError, EvalFailed) as e:
        sys.exit(f"python -m mhar_titan.eval: {e}")
    except KeyboardInterrupt as e:
        print(f"python -m mhar_titan.eval: {e or 'interrupted'}", file=sys.stderr)
        sys.exit(130)
