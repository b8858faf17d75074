"""The command line of `python -m mhar_titan.eval`: lm-evaluation-harness on both arms of a pair, one step
(pair.py), or every kept step as the pair runs (watch.py: --watch, --once), with a paired table.

    python -m mhar_titan.eval runs/<pair> --tasks mhar_tiny_cloze [--step N] [--weights raw,ema] [--limit N]
    python -m mhar_titan.eval runs/<pair> --once --tasks mhar_tiny_cloze
    python -m mhar_titan.eval runs/<pair> --watch --suite paper --confirm-run-unsafe-code --device cuda --dtype bf16

Every refusal is one line (exit 2 for tasks refused before any export, 1 otherwise); a stop by SIGTERM or
Ctrl-C exits 143 or 130 after removing the scratch exports.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from mhar_titan.eval.harness import UNSAFE_FLAG, TaskRefused
from mhar_titan.eval.pair import EvalFailed, evaluate_pair
from mhar_titan.eval.suites import SUITES
from mhar_titan.eval.watch import Stopped, watch

PROG = "python -m mhar_titan.eval"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("pair", help="the pair's folder: runs/NAME with control/ and mhar/")
    p.add_argument("--tasks", default=None, help="comma-separated lm-eval tasks (mhar_tiny_cloze: offline demo)")
    suites = "a named task suite instead of --tasks: paper = MMLU, GPQA, GSM8K, MATH, HumanEval and MBPP as the paper"
    p.add_argument(
        "--suite", default=None, choices=tuple(SUITES), help=f"{suites} ran them (mhar_titan/eval/suites.py)"
    )
    p.add_argument("--step", type=int, default=None, help="default: the newest step both arms have")
    p.add_argument("--weights", default="raw,ema", help="raw, ema or raw,ema")
    p.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: each task's own)")
    p.add_argument("--batch-size", default="8", help="lm-eval batch size: a number or auto (default 8)")
    p.add_argument("--device", default="cpu", help="where the exported models run: cpu, cuda (default cpu)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="the models' dtype")
    p.add_argument("--out", default=None, help="the report's folder (default: <pair>/compare)")
    p.add_argument(
        "--keep-exports",
        action="store_true",
        help="keep <pair>/eval/<arm>-<weights>-step-N once evaluated (removed otherwise, also on errors)",
    )
    p.add_argument(
        UNSAFE_FLAG,
        action="store_true",
        help="allow tasks that run the code the model generates "
        "(humaneval, mbpp: lm-eval's confirm_run_unsafe_code); run them in a sandbox",
    )
    mode = p.add_mutually_exclusive_group()
    watching = "evaluate every kept step of both arms as it lands, into <pair>/eval/store, until both runs finish"
    mode.add_argument("--watch", action="store_true", help=f"{watching} (their [training] steps) or SIGTERM")
    mode.add_argument(
        "--once", action="store_true", help="as --watch, but evaluate the kept steps not yet evaluated and exit"
    )
    p.add_argument("--poll", type=float, default=300.0, help="with --watch: seconds between looks (default 300)")
    p.add_argument(
        "--settle",
        type=float,
        default=60.0,
        help="with --watch/--once: a checkpoint without checksums "
        "is read once its .metadata is this many seconds old (default 60)",
    )
    p.add_argument(
        "--scratch",
        default=None,
        help="with --watch/--once: the folder for the exports (default "
        "<pair>/eval; node-local disk is faster); they are removed after each evaluation",
    )
    p.add_argument(
        "--no-base",
        action="store_true",
        help="with --watch/--once: no base column (the base is otherwise evaluated once as step 0)",
    )
    return p


def refuse_mixed(args: argparse.Namespace) -> None:
    """Options of one form given to the other: refused, not ignored."""
    if args.watch or args.once:
        for given, option in ((args.step is not None, "--step"), (args.keep_exports, "--keep-exports")):
            if given:
                raise ValueError(f"{option} is for one step; --watch and --once evaluate every kept step")
    else:
        for given, option in ((args.scratch, "--scratch"), (args.no_base, "--no-base")):
            if given:
                raise ValueError(f"{option} goes with --watch or --once")


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # for what imports datasets later (__main__.py sets it first)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        refuse_mixed(args)
        if args.watch or args.once:
            watch(Path(args.pair), args)
        else:
            evaluate_pair(Path(args.pair), args)
    except TaskRefused as e:  # nothing exported: as a usage error
        print(f"{PROG}: {e}", file=sys.stderr)
        sys.exit(2)
    except (ValueError, FileNotFoundError, EvalFailed) as e:
        sys.exit(f"{PROG}: {e}")
    except Stopped as e:
        where = f"; the evaluation of {e.in_flight} was aborted" if getattr(e, "in_flight", "") else ""
        print(
            f"{PROG}: stopped by {e}{where}, scratch exports removed; {getattr(e, 'records', 0)} records in the "
            "store; the same command resumes",
            file=sys.stderr,
        )
        sys.exit(128 + e.signum)
    except KeyboardInterrupt as e:
        print(f"{PROG}: {e or 'interrupted'}", file=sys.stderr)
        sys.exit(130)
