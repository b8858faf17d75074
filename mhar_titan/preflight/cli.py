"""`python -m mhar_titan.preflight CONTROL.toml MHAR.toml [--section.key value ...]`: the whole pipeline on the
GPUs it is given (2 CPU ranks without one), one row per stage, before a two-day pair.

a-c. environment, kernels, hardware per rank: one torchrun job (probe.py)
d.   the pair from the configs: the base (or a random one of its architecture, cut to a depth the GPUs hold),
     each arm trained, checkpointed midway, SIGKILLed, relaunched and compared bit for bit (pair.py)
e-f. speed and memory against the plan, the graft's start (verdicts.py)
g-h. exports read back by transformers, lm-eval on both arms (exports.py, evaluate.py)
i.   the paired report, as mhar_titan.compare writes it
Everything settles before the first job (checks.py); a problem there is one line and exit 2. The table goes to the
console and, with the details, to runs/preflight/<timestamp>/report.md; any FAIL exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import shutil
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from data.atomic import write_text
from mhar_titan import plan
from mhar_titan.compare.pair import compare
from mhar_titan.components.checkpoint.layout import FOLDER
from mhar_titan.hf.export import init_hf
from mhar_titan.hf.files import DTYPES
from mhar_titan.model.sources import SourceLayout
from mhar_titan.preflight import checks, verdicts
from mhar_titan.preflight.evaluate import eval_stage
from mhar_titan.preflight.exports import TOKENS, export_stage, fp32_matmuls, run_checks
from mhar_titan.preflight.exports import merge as merge_exports
from mhar_titan.preflight.pair import REPO, JobFailed, PairSettings, gates_moved, moved_stages, run_killed, run_resumed
from mhar_titan.preflight.probe import gpu_memory_bytes, probe_stages
from mhar_titan.preflight.report import report_markdown
from mhar_titan.preflight.resume import resume_check
from mhar_titan.preflight.stages import Stage, failed, table

ARMS = ("control", "mhar")
STAGE_NAMES = dict(
    a="environment",
    b="kernels",
    c="hardware",
    d="pair: train, kill, resume",
    e="speed and memory",
    f="graft's start",
    g="exports",
    h="evaluation",
    i="report",
)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog="python -m mhar_titan.preflight",
        description="The whole pipeline on these GPUs (or 2 CPU ranks) in minutes: environment, kernels, hardware "
        "per rank, the pair from the configs with a SIGKILL and a bitwise resume, speed and memory against the plan, "
        "exports read by transformers, lm-eval, the paired report. Other --section.key value arguments are the "
        "configs' overrides, as for training.",
    )
    p.add_argument("control", help="the control arm's TOML")
    p.add_argument("mhar", help="the MHAR arm's TOML (the control's with [mhar] enable = true)")
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: every visible GPU, or 2 CPU processes)")
    p.add_argument("--steps", type=int, default=40, help="training steps an arm (default 40; checkpoint at half)")
    p.add_argument("--layers", type=int, default=None, help="the depth when the full one does not fit")
    p.add_argument(
        "--kill",
        choices=("mhar", "both"),
        default="mhar",
        help="the arms checkpointed midway, SIGKILLed and resumed (default mhar: its state holds the control's; "
        "the control then trains once, uninterrupted)",
    )
    p.add_argument("--out", default="runs/preflight", help="reports go to OUT/<timestamp>/ (default runs/preflight)")
    p.add_argument("--checkpoints", default=None, help="a folder on another file system for the pair's checkpoints")
    p.add_argument("--tasks", default="mhar_tiny_cloze", help="lm-eval tasks (default: the offline demo task)")
    p.add_argument("--limit", type=int, default=None, help="documents per lm-eval task (default: all)")
    p.add_argument("--arch", default="marin8b", help="the architecture of a random base when the base is absent")
    p.add_argument("--tokenizer", default=str(REPO / "assets" / "tiny"), help="a random base's tokenizer folder")
    p.add_argument("--random-base", action="store_true", help="a random base even when the configs' base is there")
    p.add_argument("--gpu-memory", type=plan.parse_memory, default=None, help="plan with this memory per GPU")
    p.add_argument("--stages", default="abcdefghi", help="the stages to run (default all; d comes with e-i)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints, exports and random base afterwards")
    return p.parse_known_args(argv)


def _probe(out: Path, nproc: int, cuda: bool, geometry: dict[str, int]) -> list[Stage]:
    began = time.monotonic()
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1"),
        *("--nproc-per-node", str(nproc), "-m", "mhar_titan.preflight.probe", "--out", str(out)),
    ]
    for key, value in geometry.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    env = {**os.environ} if cuda else {**os.environ, "TRITON_INTERPRET": "1"}
    with open(out.parent / "logs" / "probe.log", "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
    return probe_stages(out, time.monotonic() - began)


def _in_process(fn: Callable[[], object], log: Path) -> tuple[int, float]:
    """(exit code, seconds) of `fn` run here, its output to `log` as a subprocess's would go: a step that needs no
    process of its own (the base, the exports) saves the ten-odd seconds a GPU process takes to import and start.
    An exception is its failure (1, the traceback in the log); an interrupt is not caught. The GPU memory it cached
    is released afterwards (this process keeps only its CUDA context during the jobs)."""
    began = time.monotonic()
    with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        try:
            fn()
            code = 0
        except Exception:
            traceback.print_exc()
            code = 1
    gc.collect()
    if torch.cuda.is_initialized():  # the GPU memory this process cached goes back before the next job
        torch.cuda.empty_cache()
    return code, time.monotonic() - began


def _run(cmd: list[str], log: Path) -> tuple[int, float]:
    began = time.monotonic()
    with open(log, "w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    return code, time.monotonic() - began


class Preflight:
    """One preflight: its settings, resolved before anything runs, and the stages as they finish."""

    def __init__(self, args: argparse.Namespace, overrides: list[str], argv: list[str]):
        self.args, self.overrides, self.argv = args, overrides, argv
        self.began = time.monotonic()
        self.cuda = torch.cuda.is_available()
        self.nproc = args.nproc or (torch.cuda.device_count() if self.cuda else 2)
        self.root = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
        self.stages: list[Stage] = []
        self.export_runs: dict[str, tuple[int, float]] = {}
        self.notes: list[str] = []
        wanted = set(args.stages)
        if wanted - set(STAGE_NAMES):
            raise ValueError(f"--stages {args.stages!r}: letters among {''.join(STAGE_NAMES)}")
        if wanted & set("efghi"):
            wanted |= {"d"}
        if "h" in wanted:
            wanted |= {"g"}
        self.wanted = wanted
        self.kill = ARMS if args.kill == "both" else ("mhar",)
        if args.steps < 8:
            raise ValueError(f"--steps {args.steps}: at least 8 (a checkpoint at half, a kill after it, a resume)")
        paths = (args.control, args.mhar)
        self.cfgs = {arm: checks.load_arm(p, overrides) for arm, p in zip(ARMS, paths, strict=True)}
        checks.check_pair(self.cfgs["control"], self.cfgs["mhar"], paths)
        cfg = self.cfgs["control"]
        explicit = any(o.startswith("--model.hf_assets_path") for o in overrides)
        self.base = checks.resolve_base(cfg, args.control, explicit, args.arch, args.random_base, args.tokenizer)
        if "d" in wanted:
            checks.check_data(cfg, args.control, self.nproc)
        self.plan_cfg = checks.plan_cfg(args.mhar, overrides, self.base)  # its [mhar] settles the routing geometry
        self.full = self.base.args.n_layers
        self.layers = self.full
        blocks = self.cfgs["mhar"].mhar.num_blocks
        if args.layers is not None and (args.layers < 1 or args.layers > self.full or args.layers % blocks):
            raise ValueError(
                f"--layers {args.layers}: must be a multiple of [mhar] num_blocks = {blocks}, at most {self.full}"
            )

    def add(self, stage: Stage) -> None:
        """A finished stage: printed, and the report rewritten, so a preflight cut short still says what passed."""
        self.stages.append(stage)
        self.stages.sort(key=lambda st: st.key)  # the table in stage order, whatever order they finished in
        print(
            f"preflight: {stage.key}. {stage.name}: {stage.result} ({stage.seconds:.0f} s) {stage.figure}", flush=True
        )
        self.write_report()

    def write_report(self) -> None:
        seconds = time.monotonic() - self.began
        write_text(self.root / "report.md", report_markdown(self, self.argv, seconds, socket.gethostname()))

    # -- the stages ----------------------------------------------------------------------------------------

    def probe(self) -> None:
        cfg, geo = self.cfgs["mhar"], plan.geometry(self.plan_cfg, self.nproc, True)
        tokens = cfg.training.seq_len * cfg.training.local_batch_size if self.cuda else 64
        t = cfg.training
        attention = f"{t.local_batch_size},{geo.heads},{t.seq_len},{geo.dim // geo.heads}"
        layout = SourceLayout(cfg.mhar.num_blocks, geo.layers)  # at the config's depth
        geometry = dict(
            dim=geo.dim,
            num_heads=cfg.mhar.num_heads,
            max_sources=layout.max_sources,
            sites=layout.sites_per_block,  # a block's: what the run routes at once
            tokens=tokens,
            gemm_hidden=geo.hidden,
            block_elements=geo.layer_params,
            attention=attention,
        )
        (self.root / "probe").mkdir(parents=True, exist_ok=True)
        rows = _probe(self.root / "probe", self.nproc, self.cuda, geometry)
        for r in rows:
            if r.key in self.wanted:
                self.add(r)

    def settle_depth(self) -> None:
        """The depth the GPUs hold (an error if none), the base, and the room for the checkpoints."""
        memory = self.args.gpu_memory or (gpu_memory_bytes(self.root / "probe") if self.cuda else None)
        self.layers, self.plan_info = checks.choose_depth(
            self.plan_cfg, self.nproc, memory, self.args.layers, self.full
        )
        if self.layers < self.full and not self.base.random:
            self.base.random, self.base.reason = True, f"{self.base.reason}, cut to {self.layers} layers: a random base"
        self.plan_peaks = None
        if self.cuda:
            mode = self.plan_cfg.activation_checkpoint.mode
            self.plan_peaks = {
                arm: plan.estimate(plan.geometry(self.plan_cfg, self.nproc, arm == "mhar", self.layers), mode)["peak"]
                / plan.GIB
                for arm in ARMS
            }
        geo = plan.geometry(self.plan_cfg, 1, True, self.layers)
        ema = self.cfgs["control"].ema.enable
        self.checkpoint_bytes = geo.params * (4 + 8 + (4 if ema else 0))
        if "d" in self.wanted:
            where = Path(self.args.checkpoints) if self.args.checkpoints else self.root
            checks.check_room(where, 2 * self.checkpoint_bytes, "two checkpoints of one arm", "--checkpoints DIR")
            width = 2 if self.cuda else 4  # bytes a parameter of the exports and the random base: bf16 on GPUs
            checks.check_room(self.root, geo.params * width * 5, "four exports and the base", "--out DIR")

    def make_base(self) -> tuple[str, float]:
        if not self.base.random:
            return str(self.base.path), 0.0
        out = self.root / "base"
        device, dtype = ("cuda", "bf16") if self.cuda else ("cpu", "fp32")
        code, seconds = _in_process(
            lambda: init_hf(
                str(out), self.base.arch, self.base.tokenizer or None, 0, DTYPES[dtype], device, layers=self.layers
            ),
            self.root / "logs" / "base.log",
        )
        if code:
            raise JobFailed(
                f"the random base ({self.base.arch}, {self.layers} layers) failed: see {self.root}/logs/base.log"
            )
        return str(out), seconds

    def settings(self) -> PairSettings:
        steps = self.args.steps
        at = steps // 2
        return PairSettings(
            steps,
            at,
            at + max(2, (steps - at) // 2),
            self.nproc,
            self.root / "pair",
            self.root / "logs",
            sys.executable,
        )

    def pair_overrides(self, base: str, s: PairSettings) -> list[str]:
        t = self.cfgs["control"].training
        val_steps = "4" if self.cuda else "2"
        return [
            *self.overrides,
            *("--model.flavor", "hf", "--model.hf_assets_path", base, "--checkpoint.initial_load_in_hf"),
            *("--training.steps", str(s.steps), "--training.global_batch_size", str(t.local_batch_size * s.nproc)),
            *("--checkpoint.enable", "--checkpoint.folder", FOLDER),
            *("--checkpoint.interval", str(s.checkpoint_at), "--checkpoint.keep_latest_k", "2"),
            *("--checkpoint.keep_every", "0"),
            *("--metrics.log_freq", "1", "--metrics.enable_tensorboard"),
            *("--validation.enable", "--validation.freq", str(math.gcd(s.kill_after, s.steps))),
            *("--validation.steps", val_steps),
            "--validation.at_start",
            *moved_stages(self.cfgs["control"], s)[0],
        ]

    def link_checkpoints(self, s: PairSettings) -> None:
        for arm in ARMS:
            (s.pair / arm).mkdir(parents=True, exist_ok=True)
            if self.args.checkpoints:
                target = Path(self.args.checkpoints).resolve() / f"{self.root.name}-{arm}"
                target.mkdir(parents=True, exist_ok=True)
                (s.pair / arm / FOLDER).symlink_to(target)

    def pair(self) -> dict[str, Any] | None:
        began = time.monotonic()
        s = self.settings()
        s.logs.mkdir(parents=True, exist_ok=True)
        depth = (f"{self.layers} of {self.full} layers" if self.layers < self.full else f"{self.full} layers") + (
            ", random base" if self.base.random else ", the configs' base"
        )
        if note := moved_stages(self.cfgs["control"], s)[1]:
            depth += f"; {note}"
        try:
            base, _ = self.make_base()
            self.base_folder = base
            self.link_checkpoints(s)
            overrides = self.pair_overrides(base, s)
            arms = {}
            for arm, path in zip(ARMS, (self.args.control, self.args.mhar), strict=True):
                if arm in self.kill:
                    killed = run_killed(path, arm, s, overrides)
                    rerun = run_killed(path, arm, s, overrides, rerun=True)  # this job's own spread
                    resumed = run_resumed(path, arm, s, overrides, drop_loaded=not self.args.keep)
                    check = resume_check(killed["scalars"], resumed["scalars"], s.checkpoint_at, rerun["scalars"])
                else:  # one job, its only checkpoint the last step's (for the exports)
                    once = [*overrides, "--checkpoint.interval", str(s.steps)]
                    killed = resumed = run_resumed(path, arm, s, once, drop_loaded=False, resumes=False)
                    check = None
                arms[arm] = {
                    "killed": killed,
                    "resumed": resumed,
                    "resume": check,
                    "gates": gates_moved(resumed["scalars"]) if arm == "mhar" else None,
                }
                # The arm's exports now, from its last checkpoint, then its checkpoints go: one arm's two
                # checkpoints at a time on the scratch disk.
                exporting = time.monotonic()
                if "g" in self.wanted:
                    self.export_arm(arm, s)
                if not self.args.keep:
                    self.drop_checkpoints(s, arm)
                began += time.monotonic() - exporting  # stage g's time, not d's
        except (JobFailed, OSError) as e:
            self.add(failed("d", STAGE_NAMES["d"], str(e), time.monotonic() - began))
            return None
        self.add(verdicts.pair_stage(arms, s, depth, time.monotonic() - began))
        if "e" in self.wanted:
            self.add(verdicts.speed_memory_stage(arms, self.plan_peaks, s))
        return {"settings": s, "arms": arms}

    def compare(self, s: PairSettings) -> dict[str, Any] | None:
        began = time.monotonic()
        try:
            result = compare(s.pair)
        except (ValueError, FileNotFoundError, KeyError) as e:
            self.compared_stage = verdicts.compare_stage(None, f"mhar_titan.compare: {e}", time.monotonic() - began)
            return None
        self.compared_stage = verdicts.compare_stage(result, None, time.monotonic() - began)
        return result

    def export_arm(self, arm: str, s: PairSettings) -> None:
        """One arm's raw and EMA exports (bf16 on GPUs, as users evaluate them) read back and checked."""
        exports = self.root / "exports"
        device = torch.device("cuda" if self.cuda else "cpu")
        dtype = torch.bfloat16 if self.cuda else torch.float32
        json_path = exports / f"exports-{arm}.json"

        def checks() -> None:
            with fp32_matmuls(device):
                run_checks(s.pair, exports, s.steps, device, TOKENS, json_path, (arm,), dtype)

        self.export_runs[arm] = _in_process(checks, self.root / "logs" / f"exports-{arm}.log")

    def drop_checkpoints(self, s: PairSettings, arm: str) -> None:
        folder = s.pair / arm / FOLDER
        if folder.is_symlink():
            shutil.rmtree(folder.resolve(), ignore_errors=True)
            folder.unlink()
        else:
            shutil.rmtree(folder, ignore_errors=True)

    def exports_and_eval(self, s: PairSettings) -> None:
        exports = self.root / "exports"
        device = "cuda" if self.cuda else "cpu"
        seconds = sum(t for _, t in self.export_runs.values())
        parts = [exports / f"exports-{arm}.json" for arm in ARMS]
        result = exports / "exports.json"
        if all(p.is_file() for p in parts):
            merge_exports(parts, result)
            stage = export_stage(result, seconds)
        else:
            codes = ", ".join(f"{arm} {code}" for arm, (code, _) in self.export_runs.items())
            stage = failed("g", STAGE_NAMES["g"], f"exports failed ({codes}; logs/exports-*.log)", seconds)
        self.add(stage)
        if "h" in self.wanted and stage.ok:
            dtype = "bf16" if self.cuda else "fp32"
            cmd = [
                *(sys.executable, "-m", "mhar_titan.preflight.evaluate", str(s.pair), str(exports)),
                *("--step", str(s.steps), "--tasks", self.args.tasks),
                *("--device", device, "--dtype", dtype),
            ]
            if self.args.limit:
                cmd += ["--limit", str(self.args.limit)]
            code, seconds = _run(cmd, self.root / "logs" / "evaluate.log")
            if (exports / "eval.json").is_file():
                self.add(eval_stage(exports / "eval.json", seconds))
            else:
                self.add(failed("h", STAGE_NAMES["h"], f"evaluate exited {code} (logs/evaluate.log)", seconds))
        elif "h" in self.wanted:
            self.add(failed("h", STAGE_NAMES["h"], "not run: the exports failed"))

    def clean(self, s: PairSettings | None) -> None:
        if self.args.keep:
            return
        shutil.rmtree(self.root / "exports", ignore_errors=True)
        if self.base.random:
            shutil.rmtree(self.root / "base", ignore_errors=True)
        for arm in ARMS if s else ():
            self.drop_checkpoints(s, arm)


def run(pf: Preflight) -> None:
    """The stages in order; a refusal from the plan (a GPU too small) comes after the probe, before any training."""
    if pf.wanted & set("abc") or pf.cuda:  # the GPUs' memory comes from the probe
        pf.probe()
    pf.settle_depth()
    if "d" not in pf.wanted:
        return
    pair = pf.pair()
    if pair is None:
        for k in "efghi":
            if k in pf.wanted:
                pf.add(failed(k, STAGE_NAMES[k], "not run: the pair failed"))
        return
    s = pair["settings"]
    try:
        if "g" in pf.wanted:
            pf.exports_and_eval(s)
        compared = pf.compare(s)  # after the evaluation: its report holds the Evaluation section
        if "f" in pf.wanted:
            pf.add(verdicts.start_stage(compared) if compared else failed("f", STAGE_NAMES["f"], "no comparison"))
        if "i" in pf.wanted:
            pf.add(pf.compared_stage)
    finally:
        pf.clean(s)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args, overrides = parse_args(argv)
    try:
        pf = Preflight(args, overrides, argv)
        pf.root.mkdir(parents=True, exist_ok=True)
        (pf.root / "logs").mkdir(exist_ok=True)
        print(
            f"preflight: {pf.nproc} {'GPU' if pf.cuda else 'CPU'} ranks; {pf.base.reason}; report in {pf.root}",
            flush=True,
        )
        run(pf)
    except ValueError as e:  # settled before any training: one line
        print(f"python -m mhar_titan.preflight: {e}", file=sys.stderr)
        sys.exit(2)
    seconds = time.monotonic() - pf.began
    pf.write_report()
    report = pf.root / "report.md"
    print(table(pf.stages))
    bad = [s.key for s in pf.stages if not s.ok]
    print(f"preflight: {'FAIL (' + ', '.join(bad) + ')' if bad else 'PASS'} in {seconds / 60:.1f} min; {report}")
    sys.exit(1 if bad else 0)
