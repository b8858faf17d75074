"""Stage h of the preflight: lm-evaluation-harness on both arms' exports from stage g (raw and EMA weights),
through the same code as `python -m mhar_titan.eval`, so the tasks, settings and paired table are the ones
the long pair will be judged by.

    python -m mhar_titan.preflight.evaluate PAIR EXPORTS --step N --tasks mhar_tiny_cloze[,...] \\
        --device cuda|cpu --dtype fp32|bf16 [--limit L] [--batch-size B]

The folders EXPORTS/<arm>-<weights> (exports.py) are evaluated as they are, not exported again: an 8B export
takes minutes. The paired table goes where `python -m mhar_titan.eval` puts it (PAIR/compare/eval.md,
eval.json, the "Evaluation" section of report.md, TensorBoard PAIR/eval); EXPORTS/eval.json holds each model's
metrics and the paired rows for `eval_stage`. Offline as mhar_titan.eval: a task that is unknown, or whose
dataset is not in the local HF datasets cache, is refused in one line naming it, before any model runs
(exit 2, the JSON says why). Exit 0 when every model was evaluated, whatever the metrics; non-zero on a crash,
after writing what was measured and an "error".
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # the command: offline before datasets is imported (see mhar_titan/eval/__main__.py)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402  (after the environment is set)
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from data.atomic import write_text  # noqa: E402
from mhar_titan.eval.harness import TaskRefused, Tasks, one_line, run_harness  # noqa: E402
from mhar_titan.eval.pair import ARMS, EvalFailed, evaluate_models, table_rows, write_outputs  # noqa: E402
from mhar_titan.preflight.stages import Stage, failed, read_result  # noqa: E402

WEIGHTS = ("raw", "ema")
MODELS = tuple(f"{arm}-{weights}" for arm in ARMS for weights in WEIGHTS)
KEY, NAME = "h", "evaluation"
PROG = "python -m mhar_titan.preflight.evaluate"
FIGURE_TASKS = 3  # tasks named in the figure; the details have all


def leaf_tasks(tasks: Tasks) -> list[str]:
    """The tasks lm-eval scores (a group's or tag's members, not the group): each must come back from every model."""
    names = []
    for item in tasks.built:
        for task in item.get_all_tasks() if hasattr(item, "get_all_tasks") else [item]:
            names.append(task.task_name)
    return names


def metrics_of(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per task, lm-eval's numeric metrics (`metric,filter`) without their stderrs."""
    return {
        task: {
            k: float(v)
            for k, v in values.items()
            if "," in k and "_stderr" not in k and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        for task, values in results.items()
    }


def evaluate_exports(
    pair: Path, exports: Path, step: int, tasks: list[str], args: argparse.Namespace, result: dict[str, Any]
) -> None:
    """Both arms' exported folders (raw and EMA) through lm-eval and paired; `result` is filled as it goes."""
    folders = {name: exports / name for name in MODELS}
    missing = [str(f) for f in folders.values() if not (f / "config.json").is_file()]
    if missing:
        raise FileNotFoundError(f"no export at {', '.join(missing)}: run python -m mhar_titan.preflight.exports first")
    recorded = exports / "exports.json"
    if recorded.is_file() and json.loads(recorded.read_text()).get("step") not in (None, step):
        raise ValueError(f"{recorded}: the exports are of step {json.loads(recorded.read_text())['step']}, not {step}")
    models = result["models"] = {}

    def score(arm: str, weights: str, built: Tasks) -> dict[str, Any]:
        result.setdefault("expected_tasks", leaf_tasks(built))
        name = f"{arm}-{weights}"
        began = time.perf_counter()
        out = run_harness(folders[name], built, args)
        models[name] = {"folder": str(folders[name]), "seconds": round(time.perf_counter() - began, 2)}
        models[name]["metrics"] = metrics_of(out["results"])
        return out

    result["results"] = evaluate_models(tasks, list(WEIGHTS), step, score, doing="lm-eval on the export, ")
    print(write_outputs(pair, pair / "compare", step, tasks, result["results"]))


def problems(result: dict[str, Any]) -> list[str]:
    """What keeps the stage from passing: a model not evaluated, a task without metrics, a non-finite value."""
    expected = result.get("expected_tasks") or []
    out = [] if expected else ["no task was evaluated"]
    for name in MODELS:
        model = result.get("models", {}).get(name)
        if model is None:
            out.append(f"{name}: not evaluated")
            continue
        for task in expected:
            values = model["metrics"].get(task)
            bad = [m.removesuffix(",none") for m, v in (values or {}).items() if not math.isfinite(v)]
            if not values:
                out.append(f"{name}: {task} gave no metric")
            elif bad:
                out.append(f"{name}: {task} {', '.join(bad)} not finite")
    for weights, rows in (result.get("results") or {}).items():
        for r in rows:
            if not all(isinstance(r[k], float) and math.isfinite(r[k]) for k in ("control", "mhar", "delta")):
                out.append(f"{weights}: {r['task']} {r['metric']} not finite in the paired table")
    return out


def _headline(result: dict[str, Any]) -> str:
    """Per task (the first few), its first metric for both arms' raw weights and the paired delta."""
    weights = "raw" if "raw" in result["results"] else next(iter(result["results"]))
    parts = []
    for task in result["expected_tasks"][:FIGURE_TASKS]:
        row = next((r for r in result["results"][weights] if r["task"] == task), None)
        if row is None:
            continue
        metric = row["metric"].split(",")[0]
        label = task if metric == "acc" else f"{task} {metric}"
        se = "" if row["delta_stderr"] is None else f" ± {row['delta_stderr']:.3f}"
        parts.append(
            f"{label}: control {row['control']:.3f}, MHAR {row['mhar']:.3f} ({weights}), delta {row['delta']:+.3f}{se}"
        )
    more = len(result["expected_tasks"]) - FIGURE_TASKS
    if not parts:  # no metric that both arms report (the details have each model's)
        return f"{len(result['expected_tasks'])} tasks evaluated on all four models, no paired metric"
    return "; ".join(parts) + (f"; {more} more tasks in the details" if more > 0 else "")


def eval_stage(path: Path, seconds: float) -> Stage:
    """Stage h from EXPORTS/eval.json: PASS iff every task ran on all four models and gave finite metrics."""
    result = read_result(Path(path), KEY, NAME, PROG, "evaluation", seconds)
    if isinstance(result, Stage):
        return result
    settings = (
        f"tasks {', '.join(result.get('tasks', []))} on {result.get('device')} in {result.get('dtype')}, "
        f"{result.get('limit') or 'all'} documents per task, batch size {result.get('batch_size')}"
    )
    if result.get("refused"):
        return failed(
            KEY,
            NAME,
            result["error"],
            seconds,
            [
                f"lm-evaluation-harness refused the tasks before any model ran ({settings}): {result['error']}.",
                "",
                "What to do: check the task names (`lm-eval ls tasks`), and put their datasets in this machine's HF "
                "datasets cache (run lm-eval once with network, or copy the cache: HF_DATASETS_CACHE); the evaluation "
                "runs offline, as the long pair's will.",
            ],
        )
    details = [
        f"Both arms' exports of step {result.get('step')} (stage g, raw and EMA weights) through "
        f"lm-evaluation-harness, {settings}; delta = MHAR - control with a paired stderr and 95% CI over the "
        f"same documents (also in `{result.get('compare')}/eval.md` and the report's Evaluation section).",
        "",
        *table_rows(result.get("results") or {}),
        "| model | lm-eval time | tasks with metrics |",
        "|---|---|---|",
        *(
            f"| {name} | {m['seconds']:.1f} s | {', '.join(sorted(m['metrics']))} |"
            for name, m in (result.get("models") or {}).items()
        ),
        "",
    ]
    if result.get("error"):
        details.append(
            f"The evaluation stopped: {result['error']}. Its traceback is in the log; rerun `{PROG}` alone with the "
            "same arguments to see it (`python -m mhar_titan.eval PAIR --tasks ...` evaluates the pair the same way)."
        )
        return failed(KEY, NAME, result["error"], seconds, details)
    wrong = problems(result)
    if wrong:
        details.append(
            "What to do: a model with non-finite metrics is broken as lm-eval reads it: check stage g's logits "
            "(exports.json), then evaluate in fp32 (--dtype fp32) to tell an overflow in bf16 from bad weights; a "
            "task missing from a model's results is an lm-eval problem with that task or model (see the log)."
        )
        return Stage(KEY, NAME, False, "; ".join(wrong), seconds, details)
    return Stage(KEY, NAME, True, _headline(result), seconds, details)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("pair", type=Path, help="the pair's folder (control/, mhar/; the table goes to compare/)")
    parser.add_argument("exports", type=Path, help="the exports of stage g: EXPORTS/<arm>-<weights>")
    parser.add_argument("--step", type=int, required=True, help="the step the exports are of")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval tasks (mhar_tiny_cloze: offline demo)")
    parser.add_argument("--device", default="cpu", help="where the models run: cuda or cpu (default cpu)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the models' dtype (default fp32)")
    parser.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    parser.add_argument("--batch-size", default="8", help="lm-eval batch size: a number or auto (default 8)")
    parser.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: each task's own)")
    parser.add_argument("--json", type=Path, default=None, help="the result file (default EXPORTS/eval.json)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # for what imports datasets later (the command sets it first)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = args.json or args.exports / "eval.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tasks = [t for t in args.tasks.split(",") if t]
    result: dict[str, Any] = {
        "pair": str(args.pair),
        "exports": str(args.exports),
        "compare": str(args.pair / "compare"),
        "step": args.step,
        "tasks": tasks,
        "device": args.device,
        "dtype": args.dtype,
        "limit": args.limit,
        "batch_size": args.batch_size,
        "num_fewshot": args.num_fewshot,
    }
    try:
        evaluate_exports(args.pair, args.exports, args.step, tasks, args, result)
    except TaskRefused as e:  # nothing ran: a usage error, as in mhar_titan.eval
        write_text(path, json.dumps(result | {"ok": False, "refused": True, "error": str(e)}, indent=2) + "\n")
        print(f"{PROG}: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:
        write_text(path, json.dumps(result | {"ok": False, "error": str(e) or "interrupted"}, indent=2) + "\n")
        print(f"{PROG}: {e or 'interrupted'}", file=sys.stderr)
        sys.exit(130)
    except Exception as e:
        error = str(e) if isinstance(e, EvalFailed) else one_line(e)
        write_text(path, json.dumps(result | {"ok": False, "error": error}, indent=2) + "\n")
        traceback.print_exc()
        sys.exit(f"{PROG}: {error}")
    result["ok"] = not problems(result)
    write_text(path, json.dumps(result, indent=2) + "\n")
    print(f"{PROG}: {'PASS' if result['ok'] else 'FAIL'}: {eval_stage(path, 0.0).figure}; {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
