"""The preflight's resume verdict measured in both directions on this node's GPUs (or 2 CPU ranks), for
docs/performance.md: how far the verdict's figure stays from its bound when the resume is correct, and how far past
it each broken resume lands.

    python -m benchmarks.resume_spread CONTROL.toml MHAR.toml [--reruns 3] [--faults moments,ema,data,lr]
        [--out DIR] [--checkpoints DIR] [--section.key value ...]

Other arguments are the preflight's (`python -m mhar_titan.preflight --help`), `--section.key value` overrides
among them.

One arm (MHAR, `--arm control` for the other) is set up exactly as the preflight's stage d sets it up (the
configs' base or a random one of their architecture at the depth the GPUs hold, 40 steps, the checkpoint at 20,
the kill after the validation at 30): the first job, killed; then `--reruns` clean relaunches from its checkpoint,
each killed at the same point; then, for each fault, two relaunches with the test seam MHAR_TEST_RESUME_FAULT set
(components/checkpoint/testing.py), as the preflight would run a pipeline with that fault. Where the clean relaunches
repeat bit for bit (CPU ranks), `--fault-relaunches 1` runs one a fault and judges it against itself: the
verdict a second, identical relaunch would give. The verdict
(verdicts.resume_verdict) is then taken for every ordered pair of clean relaunches as (resumed, rerun), and for
each fault's pair, and printed with each ratio; OUT/resume_spread.json holds every figure. Nothing else of the
preflight runs, so the relaunches share one checkpoint and one base.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import time

import torch

from mhar_titan.components.checkpoint.testing import FAULTS, RESUME_FAULT_ENV
from mhar_titan.preflight import cli
from mhar_titan.preflight.pair import JobFailed, run_killed
from mhar_titan.preflight.resume import JUDGED, JUDGED_PREFIXES, compared_tags, gap, resume_check
from mhar_titan.preflight.verdicts import SPREAD_FACTOR, resume_verdict, spread_ratio


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.resume_spread",
        description=__doc__.split("\n\n")[0],
        epilog="Other arguments go to the preflight's parser: its options and --section.key value overrides.",
    )
    p.add_argument("--reruns", type=int, default=3, help="clean relaunches (at least 2)")
    p.add_argument("--faults", default="moments,ema,data,lr", help=f"comma-separated, among {', '.join(FAULTS)}")
    p.add_argument("--arm", choices=cli.ARMS, default="mhar", help="the arm killed and relaunched (default mhar)")
    p.add_argument(
        "--fault-relaunches",
        type=int,
        choices=(1, 2),
        default=2,
        help="relaunches a fault (default 2); 1 only where the clean relaunches repeat bit for bit",
    )
    ours, rest = p.parse_known_args(argv)
    faults = [f for f in ours.faults.split(",") if f]
    if ours.reruns < 2:
        p.error(f"--reruns {ours.reruns}: at least 2 (the clean pairs' spread needs two relaunches)")
    if unknown := sorted(set(faults) - set(FAULTS)):
        p.error(f"--faults {ours.faults}: {', '.join(unknown)} unknown; the faults are {', '.join(FAULTS)}")
    ours.faults = faults
    return ours, rest


def judge(runs: dict, clean: list[str], faults: list[str], checkpoint_at: int, arm: str) -> list[dict]:
    """The verdict for every ordered pair of clean relaunches as (resumed, rerun), and for each fault's two (its one
    against itself where only one ran)."""
    killed = runs["killed"]
    pairs = [(a, b, None) for a, b in itertools.permutations(clean, 2)]
    pairs += [(f"{f}-a", f"{f}-b" if f"{f}-b" in runs else f"{f}-a", f) for f in faults]
    rows = []
    for resumed, rerun, fault in pairs:
        check = resume_check(killed, runs[resumed], checkpoint_at, runs[rerun])
        ok, figure, _ = resume_verdict(arm, check, killed.get("train/loss", {}))
        r = check["rerun"]
        rows.append(
            {
                "resumed": resumed,
                "rerun": rerun,
                "fault": fault,
                "passed": ok,
                "ratio": spread_ratio(check),
                "resumed_gap": r["resumed_gap"]["rms"],
                "rerun_gap": r["rerun_gap"]["rms"],
                "spread": r["spread"]["rms"],
                "equal": check["equal"],
                "figure": figure,
            }
        )
    return rows


def pairwise(runs: dict, names: list[str], checkpoint_at: int) -> dict[str, float]:
    """Every clean run (the killed one too) against every other, on the values the verdict judges: the noise
    between two runs of the same steps."""
    killed = runs["killed"]
    steps = sorted(k for k in killed.get("train/loss", {}) if k > checkpoint_at)
    tags = [t for t in compared_tags(killed) if t in JUDGED or t.startswith(JUDGED_PREFIXES)]
    scale = {t: max((abs(v) for k, v in killed[t].items() if k in steps), default=0.0) or 1.0 for t in tags}
    return {f"{a}~{b}": gap(runs[a], runs[b], tags, steps, scale)["rms"] for a, b in itertools.combinations(names, 2)}


def bitwise(runs: dict, clean: list[str], checkpoint_at: int) -> None:
    """Refuse --fault-relaunches 1 unless the clean relaunches logged the same values, bit for bit: only then is a
    fault's second relaunch known to repeat its first."""
    for a, b in itertools.combinations(clean, 2):
        check = resume_check(runs[a], runs[b], checkpoint_at)
        if not check["equal"]:
            raise ValueError(
                f"--fault-relaunches 1: the clean relaunches {a} and {b} differ in "
                f"{check['differing_values']} values from step {check['first_differing_step']}; "
                "here a fault needs two relaunches (the default)"
            )


def main(argv: list[str] | None = None) -> None:
    try:
        measure(*parse(sys.argv[1:] if argv is None else argv))
    except (ValueError, JobFailed) as e:  # the preflight's refusals and a job that failed: one line
        sys.exit(f"python -m benchmarks.resume_spread: {e}")


def measure(ours: argparse.Namespace, rest: list[str]) -> None:
    args, overrides = cli.parse_args(rest)
    if args.gpu_memory is None and torch.cuda.is_available():
        args.gpu_memory = float(torch.cuda.mem_get_info()[0])
    pf = cli.Preflight(args, overrides, rest)
    (pf.root / "logs").mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    pf.settle_depth()
    base, _ = pf.make_base()
    s = pf.settings()
    pf.link_checkpoints(s)
    job = pf.pair_overrides(base, s)
    config = args.control if ours.arm == "control" else args.mhar
    print(
        f"resume_spread: {ours.arm}, {pf.layers} layers, {s.steps} steps, checkpoint {s.checkpoint_at}, kill "
        f"after {s.kill_after}; {ours.reruns} reruns, faults {ours.faults}; {pf.root}",
        flush=True,
    )
    runs, seconds = {}, {}

    def relaunch(name: str, fault: str | None = None) -> None:
        t = time.monotonic()
        os.environ.pop(RESUME_FAULT_ENV, None)
        if fault:
            os.environ[RESUME_FAULT_ENV] = fault
        try:
            runs[name] = run_killed(config, ours.arm, s, job, rerun=name != "killed", name=name)["scalars"]
        finally:
            os.environ.pop(RESUME_FAULT_ENV, None)
        seconds[name] = time.monotonic() - t
        print(f"resume_spread: {name} {seconds[name]:.0f} s", flush=True)

    try:
        relaunch("killed")
        for i in range(ours.reruns):
            relaunch(f"rerun{i + 1}")
        if ours.fault_relaunches == 1:
            bitwise(runs, [f"rerun{i + 1}" for i in range(ours.reruns)], s.checkpoint_at)
        for fault in ours.faults:
            for j in "ab"[: ours.fault_relaunches]:
                relaunch(f"{fault}-{j}", fault)
    finally:
        pf.drop_checkpoints(s, ours.arm)
        if pf.base.random and not args.keep:
            shutil.rmtree(pf.root / "base", ignore_errors=True)
    clean = [f"rerun{i + 1}" for i in range(ours.reruns)]
    rows = judge(runs, clean, ours.faults, s.checkpoint_at, ours.arm)
    noise = pairwise(runs, ["killed", *clean], s.checkpoint_at)
    out = {
        "arm": ours.arm,
        "layers": pf.layers,
        "settings": {"steps": s.steps, "checkpoint_at": s.checkpoint_at, "kill_after": s.kill_after},
        "bound": SPREAD_FACTOR,
        "seconds": seconds,
        "verdicts": rows,
        "pairwise_rms": noise,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "wall_s": time.monotonic() - began,
    }
    (pf.root / "resume_spread.json").write_text(json.dumps(out, indent=1))
    listing = ", ".join(f"{k} {v:.3g}" for k, v in noise.items())
    print(f"bound {SPREAD_FACTOR:g}x; pairwise rms of clean runs: {listing}")
    for row in rows:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3g}x"
        what = row["fault"] or "clean"
        print(
            f"{what:8} {row['resumed']:>9} vs {row['rerun']:<9} {'PASS' if row['passed'] else 'FAIL'} {ratio:>9}  "
            f"{row['figure']}"
        )
    print(f"resume_spread: {time.monotonic() - began:.0f} s; {pf.root / 'resume_spread.json'}")


if __name__ == "__main__":
    main()
