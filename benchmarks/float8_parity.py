"""float8 against bf16 on both arms of the pair: the loss difference against the batch noise, with a plot.

    python -m benchmarks.float8_parity run ROOT --base BASE [--steps 300] [--parallel 2] [--repeat-bf16]
                                           [--arms control] [--section.key value ...]
    python -m benchmarks.float8_parity report ROOT

`run` trains four jobs (six with `--repeat-bf16`; half with `--arms control` or `--arms mhar`) from one HF base on
the same data, through launch/torchrun.sh on this node's GPUs: each arm (configs/marin8b_control.toml,
configs/marin8b_mhar.toml, or --control and --mhar) in bf16 and with torchtitan's float8 converter (`FLOAT8`: the
rowwise recipe, the output layer left in bf16), as
ROOT/<arm>-<precision>. The base is loaded and nothing is saved (`--checkpoint.load_only`), validation is off,
every step is logged; the global batch is one microbatch a rank. Other `--section.key value` arguments go to
every job (e.g. `--data.paths`; `--model.hf_assets_path` is --base). `--parallel 2` runs two jobs at a time when
the GPUs hold both: their losses are what they would be alone, their speed is not (the report says so).
`--repeat-bf16` trains each arm's bf16 job a second time (ROOT/<arm>-bf16-again): two runs of one job differ only
where kernels are not repeatable (the attention backward on a GPU), the floor below which float8's difference
cannot be told from a rerun.

`report` writes ROOT/float8_parity.{md,json,png}: per arm, float8 - bf16 training loss step by step, its mean
and mean |.| by quarter and a paired 95% CI over the last quarter, set against the bf16 run's batch noise (the
sd of its step-to-step changes / sqrt 2, as mhar_titan.compare measures it); the arms' step-1 losses in each
precision (MHAR at init computes the control, float8 or not); tokens/s and peak memory where logged; with the
repeated bf16 jobs, the same figures for bf16 again - bf16 beside float8's. The CI is too narrow to test against
0: it takes the steps as independent, and two runs that drift apart stay apart (a rerun's CI excluded 0 on an
H200), so it is read against the rerun's.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402  (after the backend is chosen)

from data.atomic import write_text  # noqa: E402
from mhar_titan.compare.stats import batch_noise, median_after_warmup, paired_ci  # noqa: E402
from mhar_titan.components.tensorboard_scalars import LOSS_TAG, load_scalars  # noqa: E402
from mhar_titan.config import parse_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ARMS = ("control", "mhar")
PRECISIONS = ("bf16", "float8")
AGAIN = "bf16-again"  # --repeat-bf16: each arm's bf16 job once more
FLOAT8 = [
    *("--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name", "rowwise"),
    *("--quantize.linear.float8.filter_fqns", "output"),
]
# Without a GPU of compute capability 8.9 or more, torchtitan converts only to torchao's emulation (the
# tensorwise recipe, no compiled model): the CPU tests run the benchmark that way.
EMULATED = [
    *("--model.converters", "quantize.linear.float8", "--quantize.linear.float8.emulate"),
    *("--quantize.linear.float8.filter_fqns", "output"),
]
MEMORY_TAG = "memory/peak_active_gib_max"
RUN_FILE = "float8_parity_run.json"  # how `run` ran the jobs


def runs_of(repeat: bool, arms: tuple[str, ...] = ARMS) -> list[str]:
    """The jobs' names (their folders under ROOT), in the order they run."""
    return [f"{a}-{p}" for a in arms for p in ((*PRECISIONS, AGAIN) if repeat else PRECISIONS)]


def job(root: Path, arm: str, precision: str, args: argparse.Namespace, extra: list[str]) -> list[str]:
    """One job's launcher command (`precision`: bf16, float8 or bf16-again)."""
    config, nproc = getattr(args, arm), args.nproc
    # with the base as the jobs get it: the config's own hf_assets_path may not exist here (torchtitan warns)
    cfg = parse_config(["--job.config_file", str(REPO / config), "--model.hf_assets_path", args.base])
    local = cfg.training.local_batch_size
    float8 = EMULATED if args.emulate else FLOAT8
    cmd = [
        *(str(REPO / "launch" / "torchrun.sh"), "--nproc", str(nproc), "--launch-id", f"float8-{arm}-{precision}"),
        *(config, "--job.dump_folder", str(root / f"{arm}-{precision}")),
        *("--model.flavor", "hf", "--model.hf_assets_path", args.base),
        *("--checkpoint.initial_load_in_hf", "--checkpoint.load_only"),
        *("--training.steps", str(args.steps), "--training.global_batch_size", str(local * nproc)),
        *("--validation.no-enable", "--metrics.log_freq", "1", "--metrics.enable_tensorboard"),
    ]
    return cmd + (float8 if precision == "float8" else []) + extra  # bf16-again: the bf16 job's command


def run(args: argparse.Namespace, extra: list[str]) -> None:
    root = Path(args.root)
    taken = [str(root / n) for n in runs_of(args.repeat_bf16, args.arms) if (root / n).exists()]
    if taken:
        raise SystemExit(f"{sys.argv[0]}: {', '.join(taken)} already there: give a new ROOT")
    if not (Path(args.base) / "config.json").is_file():
        raise SystemExit(f"{sys.argv[0]}: --base {args.base}: no config.json there (an HF checkpoint folder)")
    root.mkdir(parents=True, exist_ok=True)
    settings = {
        "steps": args.steps,
        "nproc": args.nproc,
        "parallel": args.parallel,
        "emulate": args.emulate,
        "repeat_bf16": args.repeat_bf16,
        "arms": list(args.arms),
        "control": args.control,
        "mhar": args.mhar,
        "base": args.base,
        "overrides": extra,
    }
    write_text(root / RUN_FILE, json.dumps(settings, indent=2) + "\n")  # `report` reads how the jobs shared GPUs
    queue = [tuple(n.split("-", 1)) for n in runs_of(args.repeat_bf16, args.arms)]
    running: list[tuple[str, subprocess.Popen, float]] = []
    failed = []
    while queue or running:
        while queue and len(running) < args.parallel:
            arm, precision = queue.pop(0)
            name = f"{arm}-{precision}"
            log = open(root / f"{name}.log", "w")  # noqa: SIM115  (closed with the job)
            cmd = job(root, arm, precision, args, extra)
            running.append((name, subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), time.time()))
            print(f"float8_parity: {name} started ({root / name}.log)", flush=True)
        time.sleep(2)
        for item in [r for r in running if r[1].poll() is not None]:
            name, proc, began = item
            running.remove(item)
            print(f"float8_parity: {name} exited {proc.returncode} after {time.time() - began:.0f} s", flush=True)
            if proc.returncode:
                failed.append(name)
    if failed:
        raise SystemExit(f"float8_parity: {', '.join(failed)} failed: see {root}/<name>.log")


def arm_figures(bf16: dict[int, float], fp8: dict[int, float], other: str = "float8") -> dict[str, Any]:
    """float8 (or `other`, such as a second bf16 run) - bf16 by step, by quarter and over the last quarter, in
    units of the bf16 run's batch noise."""
    steps = sorted(set(bf16) & set(fp8))
    if len(steps) < 8:
        raise ValueError(f"{len(steps)} steps in common: at least 8 are needed")
    deltas = [fp8[s] - bf16[s] for s in steps]
    noise = batch_noise([bf16[s] for s in steps])
    quarters = []
    for q in range(4):
        part = deltas[q * len(steps) // 4 : (q + 1) * len(steps) // 4]
        cut = steps[q * len(steps) // 4 : (q + 1) * len(steps) // 4]
        mean, mean_abs = statistics.fmean(part), statistics.fmean(abs(d) for d in part)
        quarters.append(
            {
                "steps": [cut[0], cut[-1]],
                "mean": mean,
                "mean_abs": mean_abs,
                "mean_over_noise": mean / noise if noise else None,
                "mean_abs_over_noise": mean_abs / noise if noise else None,
            }
        )
    last = deltas[3 * len(steps) // 4 :]
    return {
        "steps": steps,
        "deltas": deltas,
        "noise": noise,
        "quarters": quarters,
        "last_quarter_ci": paired_ci(last),
        "first": {"step": steps[0], "bf16": bf16[steps[0]], other: fp8[steps[0]]},
    }


def report(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.root)
    ran = json.loads((root / RUN_FILE).read_text()) if (root / RUN_FILE).is_file() else {}
    arms = tuple(ran.get("arms", ARMS))
    names = runs_of(bool(ran.get("repeat_bf16")), arms)
    missing = [n for n in names if not any((root / n / "tb").rglob("events.out.tfevents.*"))]
    if missing:
        raise SystemExit(
            f"float8_parity: {root}: no TensorBoard log of {', '.join(missing)} (give the ROOT `run` wrote)"
        )
    runs = {tuple(n.split("-", 1)): load_scalars(root / n / "tb") for n in names}
    for (a, p), scalars in runs.items():
        if LOSS_TAG not in scalars:
            raise SystemExit(f"float8_parity: no {LOSS_TAG!r} under {root / f'{a}-{p}' / 'tb'}")
    result: dict[str, Any] = {
        "root": str(root),
        "run": ran,
        "arms": {},
        "floor": {},
        "start": {},
        "speed": {},
        "memory": {},
    }
    for arm in arms:
        result["arms"][arm] = arm_figures(runs[arm, "bf16"][LOSS_TAG], runs[arm, "float8"][LOSS_TAG])
        if (arm, AGAIN) in runs:
            result["floor"][arm] = arm_figures(runs[arm, "bf16"][LOSS_TAG], runs[arm, AGAIN][LOSS_TAG], AGAIN)
    for p in PRECISIONS if arms == ARMS else ():  # the arms at init against each other: both are needed
        c, m = runs["control", p][LOSS_TAG], runs["mhar", p][LOSS_TAG]
        first = min(set(c) & set(m))
        result["start"][p] = {
            "step": first,
            "control": c[first],
            "mhar": m[first],
            "relative": abs(m[first] - c[first]) / abs(c[first]),
        }
    for key, scalars in runs.items():
        name = "-".join(key)
        result["speed"][name] = median_after_warmup(scalars.get("tokens_per_s"))
        memory = scalars.get(MEMORY_TAG)
        result["memory"][name] = max(memory.values()) if memory else None
    write_text(root / "float8_parity.json", json.dumps(result, indent=2) + "\n")
    write_text(root / "float8_parity.md", markdown(result))
    plot(root, runs, result)
    print(markdown(result))
    return result


def _f(x: float | None, fmt: str = ".2e") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _quarter_rows(figures: dict[str, dict[str, Any]]) -> list[str]:
    return [
        f"| {arm} | {i + 1} | {q['steps'][0]}-{q['steps'][1]} | {_f(q['mean'])} | {_f(q['mean_abs'])} "
        f"| {_f(q['mean_over_noise'], '.3f')} | {_f(q['mean_abs_over_noise'], '.3f')} |"
        for arm, a in figures.items()
        for i, q in enumerate(a["quarters"])
    ]


def _ci(a: dict[str, Any]) -> str:
    ci = a["last_quarter_ci"]
    return f"{_f(ci['mean'])} [{_f(ci['low'])}, {_f(ci['high'])}] over {ci['n']} steps" if ci else "-"


def markdown(r: dict[str, Any]) -> str:
    header = [
        "| arm | quarter | steps | mean delta | mean abs delta | mean / noise | mean abs / noise |",
        "|---|---|---|---|---|---|---|",
    ]
    title = "both arms" if len(r["arms"]) == len(ARMS) else f"the {', '.join(r['arms'])} arm only"
    lines = [
        f"# float8 against bf16, {title}",
        "",
        "float8 - bf16 training loss, same base, same data order; noise = the bf16 run's batch noise.",
        "",
        *header,
        *_quarter_rows(r["arms"]),
        "",
    ]
    for arm, a in r["arms"].items():
        lines.append(f"- {arm}: batch noise {_f(a['noise'], '.4f')}; last quarter's mean delta, 95% CI: {_ci(a)}")
    lines.append(
        "- the CI takes the steps as independent, but runs that drifted apart stay apart: compare it with two bf16 "
        "runs' (--repeat-bf16), not with 0"
    )
    if r.get("floor"):
        floor = (
            "bf16 again - bf16: the same job run twice, apart only where kernels are not repeatable; a float8 "
            "difference of this size cannot be told from a rerun."
        )
        lines += ["", floor, "", *header, *_quarter_rows(r["floor"]), ""]
        for arm, f in r["floor"].items():
            fp8, again = r["arms"][arm]["quarters"][-1]["mean_abs"], f["quarters"][-1]["mean_abs"]
            times = f" ({fp8 / again:.2f}x)" if again else " (the two bf16 runs' losses equal, bit for bit)"
            lines.append(
                f"- {arm}, last quarter: mean abs delta, float8 {_f(fp8)} against bf16 again {_f(again)}"
                f"{times}; bf16 again's mean delta, 95% CI: {_ci(f)}"
            )
    for p, s in r["start"].items():
        lines.append(
            f"- step {s['step']}, {p}: control {s['control']:.6f}, MHAR {s['mhar']:.6f} ({_f(s['relative'])} relative)"
        )
    speed = ", ".join(f"{k} {_f(v, ',.0f')}" for k, v in r["speed"].items())
    parallel = r.get("run", {}).get("parallel")
    if parallel is None:
        speed += f" (how the jobs shared the GPUs is unknown: no {RUN_FILE})"
    elif parallel > 1:
        speed += f" ({parallel} jobs at a time shared the GPUs: not a job's own speed, no float8/bf16 ratio)"
    memory = ", ".join(f"{k} {_f(v, '.1f')}" for k, v in r["memory"].items())
    lines += [f"- tokens/s per device (median past warm-up): {speed}", f"- peak active memory, GiB: {memory}", ""]
    return "\n".join(lines)


def plot(root: Path, runs: dict[tuple[str, str], dict[str, dict[int, float]]], r: dict[str, Any]) -> Path:
    fig = Figure(figsize=(10, 7))
    top, bottom = fig.subplots(2, 1, sharex=True)
    for (arm, p), scalars in runs.items():
        loss = scalars[LOSS_TAG]
        top.plot(sorted(loss), [loss[s] for s in sorted(loss)], lw=0.8, label=f"{arm}, {p}")
    top.set_ylabel("training loss")
    top.legend()
    for arm, a in r["arms"].items():
        line = bottom.plot(a["steps"], a["deltas"], lw=0.8, label=f"{arm}: float8 - bf16")[0]
        if arm in r.get("floor", {}):
            f, color = r["floor"][arm], line.get_color()
            bottom.plot(f["steps"], f["deltas"], lw=0.8, ls=":", color=color, label=f"{arm}: bf16 again - bf16")
        if a["noise"]:
            bottom.axhspan(-a["noise"], a["noise"], color=line.get_color(), alpha=0.12, label=f"{arm}: +- batch noise")
    bottom.axhline(0, color="black", lw=0.5)
    bottom.set_xlabel("step")
    bottom.set_ylabel("loss difference")
    bottom.legend()
    fig.tight_layout()
    path = root / "float8_parity.png"
    fig.savefig(path, dpi=120)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.float8_parity",
        description="float8 against bf16 on both arms of the pair: the loss difference against the batch noise. "
        "`run` passes further --section.key value arguments to its jobs.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser(
        "run",
        help="train the jobs: each arm in bf16 and float8 (and bf16 again with --repeat-bf16)",
        description="Train each arm in bf16 and in float8 from one HF base on this node's GPUs, then report. "
        "Further --section.key value arguments go to every job.",
    )
    r.add_argument("root", help="a new folder for the runs")
    r.add_argument("--base", required=True, help="the HF base every job loads")
    r.add_argument("--steps", type=int, default=300, help="steps a job (default 300)")
    r.add_argument("--nproc", type=int, default=1, help="GPUs a job (default 1)")
    r.add_argument("--parallel", type=int, default=1, help="jobs at a time (default 1)")
    r.add_argument("--control", default="configs/marin8b_control.toml", help="the control arm's config")
    r.add_argument("--mhar", default="configs/marin8b_mhar.toml", help="the MHAR arm's config")
    r.add_argument(
        "--arms", default=",".join(ARMS), help="comma-separated arms to train, of control and mhar (default both)"
    )
    r.add_argument("--emulate", action="store_true", help="torchao's float8 emulation (CPU): tensorwise, no compile")
    r.add_argument(
        "--repeat-bf16",
        action="store_true",
        help="train each arm's bf16 job twice: the floor (kernels that are not repeatable) for float8's difference",
    )
    s = sub.add_parser("report", help="compare the runs", description="Compare the runs `run` wrote (md, json, png).")
    s.add_argument("root", help="the folder `run` wrote")
    args, extra = p.parse_known_args(argv)
    if args.command == "report":
        if extra:
            p.error(f"report takes no overrides: {' '.join(extra)}")
        report(args)
        return
    given = args.arms.split(",")
    if not set(given) <= set(ARMS):
        p.error(f"--arms {args.arms}: the arms are {', '.join(ARMS)}")
    args.arms = tuple(a for a in ARMS if a in given)
    if args.steps < 8 or args.nproc < 1 or args.parallel < 1:
        p.error(f"--steps {args.steps} (at least 8), --nproc {args.nproc}, --parallel {args.parallel}: positive")
    run(args, extra)
    report(args)


if __name__ == "__main__":
    main()
