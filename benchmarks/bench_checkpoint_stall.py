"""How long each checkpoint save stalls training, and the host memory it takes, in each `[checkpoint] async_mode`.

Synchronous saves against each background mode, from the real trainer, side by side.

    python -m benchmarks.bench_checkpoint_stall [--modes disabled,async,async_with_pinned_mem] [--steps 81]
        [--interval 40] [--dir /mnt/ckpt/stall] [--out /tmp/stall] [--compile] [--smoke]

Each mode is its own train_cpt.py job (torchrun, one GPU) at the 8B width cut to 8 layers (`marin8b_8l`), seq
4096, microbatch 2, bf16 compute, fp32 master weights, fused AdamW, full AC, from a random initialisation, saving
every `--interval` steps into `--dir` (keep_latest_k 2; the last step's save model-only in bf16, after the timed
steps). The interval must outlast a background write (12-22 s at 8 layers on an H100 host; 40 steps are 14 s):
a save that finds the previous one still writing waits for it, and its stall then includes the wait (`waits`).
No EMA: with it a checkpoint is 45 GB and two of them, the pinned copy and the trainer do not fit a 128 GB host's
RAM disk and memory together; the EMA adds a third to each save's bytes, in every mode alike.

From the job's TensorBoard log (a line every step: `time/step_s`, the wall time between two log lines, so a save
after step N falls in step N+1's) and /proc:
  - step s: the median of the steps that follow no save (after the first, which initialises);
  - stall s: each save's following step minus that median (the first save apart: it allocates the pinned copy
    and starts torch's checkpoint process with async_with_pinned_mem);
  - trainer GiB: its peak resident memory (VmHWM, the pinned shared copy included), and the extra over the first
    mode run; other GiB: its other processes' (torch's checkpoint process), summed;
  - waits: how long a save, or the job's end, waited for a background save still writing (the trainer's log).
Every complete checkpoint is checked to be sealed (each rank's checksums before `.metadata`), the last interval
one verified byte for byte.

`--smoke` runs the tiny flavor on CPU for a few steps: the plumbing, not a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
from pathlib import Path

from mhar_titan.components.checkpoint.checksums import missing_manifests, read_manifests, verify_share
from mhar_titan.components.checkpoint.layout import COMPLETE, complete_steps, step_dir, step_folder
from mhar_titan.components.lifetime import descendants
from mhar_titan.components.tensorboard_scalars import read_scalars

REPO = Path(__file__).resolve().parents[1]
MODES = ("disabled", "async", "async_with_pinned_mem")
GPU = [
    *("--model.flavor", "marin8b_8l", "--training.seq_len", "4096", "--training.local_batch_size", "2"),
    *("--training.mixed_precision_param", "bfloat16", "--optimizer.implementation", "fused"),
    *("--activation_checkpoint.mode", "full"),
]
SMOKE = ["--model.flavor", "tiny", "--training.seq_len", "128", "--training.local_batch_size", "2"]
WAITED = re.compile(r"waited ([0-9.]+) s for the background save of \S*step-(\d+)")
GIB = 2**30


def mode_command(
    mode: str, run: Path, folder: Path, steps: int, interval: int, smoke: bool, compile_: bool
) -> list[str]:
    """The job of one mode: train_cpt.py on one rank, saving every `interval` steps into `folder`."""
    args = [
        *("--job.config_file", str(REPO / "configs" / "tiny_cpu.toml"), "--job.dump_folder", str(run)),
        *("--training.steps", str(steps), "--lr_scheduler.warmup_steps", "2"),
        *("--lr_scheduler.total_steps", str(steps), "--metrics.log_freq", "1"),
        *("--validation.no-enable", "--ema.no-enable", "--spikes.no-enable"),
        *("--checkpoint.enable", "--checkpoint.folder", str(folder), "--checkpoint.interval", str(interval)),
        *("--checkpoint.keep_latest_k", "2", "--checkpoint.async_mode", mode, "--checkpoint.last_save_model_only"),
        *("--checkpoint.export_dtype", "bfloat16"),
        *(SMOKE if smoke else GPU),
        *(["--compile.enable", "--compile.components", "model,loss"] if compile_ else ["--compile.no-enable"]),
    ]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    return [*launcher, str(REPO / "train_cpt.py"), *args]


def stalls(step_s: dict[int, float], steps: int, interval: int) -> dict[str, object]:
    """The median step that follows no save (step 1 left out), and each save's following step minus it."""
    saves = [s for s in range(interval, steps, interval)]
    after = {s + 1 for s in saves}
    clean = [v for s, v in step_s.items() if s > 1 and s not in after]
    if not clean:
        raise ValueError(f"no step after step 1 follows no save (steps {sorted(step_s)}, saves {saves})")
    median = statistics.median(clean)
    return {
        "step_s": median,
        "stall_s": {s: step_s[s + 1] - median for s in saves if s + 1 in step_s},
        "steps_s": dict(sorted(step_s.items())),
    }


def _status_kib(pid: int, field: str) -> int:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(m[1]) if m else 0


class PeakMemory:
    """Samples the launcher's process tree every `every` s: each process's peak resident memory (VmHWM)."""

    def __init__(self, root: int, every: float = 0.25):
        self.root, self.every = root, every
        self.peaks: dict[int, tuple[int, str]] = {}  # pid: (VmHWM KiB, command line)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            for pid in descendants(self.root):
                hwm = _status_kib(pid, "VmHWM")
                if hwm:
                    if pid not in self.peaks:
                        try:
                            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                        except OSError:
                            cmd = ""
                        self.peaks[pid] = (hwm, cmd)
                    self.peaks[pid] = (max(hwm, self.peaks[pid][0]), self.peaks[pid][1])

    def finish(self) -> dict[str, float]:
        """{"trainer": the trainer's peak GiB, "other": its other processes' peaks, summed (GiB)}."""
        self.stop.set()
        self.thread.join()
        trainer = [
            kib for kib, cmd in self.peaks.values() if "train_cpt.py" in cmd and "torch.distributed.run" not in cmd
        ]
        other = [kib for kib, cmd in self.peaks.values() if "train_cpt.py" not in cmd]
        return {"trainer": max(trainer, default=0) * 1024 / GIB, "other": sum(other) * 1024 / GIB}


def check_checkpoints(folder: Path, interval: int, last: int) -> str:
    """Every complete checkpoint sealed (each rank's checksums written before `.metadata`), the newest interval
    one before the `last` step's verified byte for byte; a line saying so, or an error."""
    steps = complete_steps(str(folder))
    for step in steps:
        sealed = step_dir(str(folder), step)
        recorded = read_manifests(sealed)
        if missing_manifests(sealed) or COMPLETE not in recorded or not recorded:
            raise RuntimeError(f"{sealed}: not sealed (manifests {sorted(recorded)})")
    newest = max((s for s in steps if s % interval == 0 and s < last), default=None)
    if newest is None:
        raise RuntimeError(f"{folder}: no complete interval checkpoint (complete: {steps})")
    problems, unverified = verify_share(step_dir(str(folder), newest), 0, 1)
    if problems or unverified:
        raise RuntimeError(f"{step_folder(newest)}: {problems or unverified}")
    return f"complete and sealed: steps {steps}; {step_folder(newest)} verified"


def run_mode(mode: str, out: Path, folder: Path, steps: int, interval: int, smoke: bool, compile_: bool) -> dict:
    run = out / mode
    shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(folder, ignore_errors=True)
    cmd = mode_command(mode, run, folder, steps, interval, smoke, compile_)
    print(f"[{mode}] {' '.join(cmd)}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open(out / f"{mode}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        memory = PeakMemory(proc.pid)
        rc = proc.wait()
        peaks = memory.finish()
    text = (out / f"{mode}.log").read_text()
    if rc != 0:
        raise RuntimeError(
            f"[{mode}] exited {rc} (trainer peak {peaks['trainer']:.1f} GiB, other processes "
            f"{peaks['other']:.1f} GiB); log in {out / f'{mode}.log'}:\n{text[-3000:]}"
        )
    result = {"mode": mode, **stalls(read_scalars(run, "time/step_s"), steps, interval), **peaks}
    result["waits_s"] = {int(step): float(s) for s, step in WAITED.findall(text)}
    result["checkpoints"] = check_checkpoints(folder, interval, steps)
    shutil.rmtree(folder, ignore_errors=True)  # the RAM disk's room for the next mode
    print(f"[{mode}] {result['checkpoints']}", flush=True)
    return result


def table(results: list[dict]) -> str:
    """The modes side by side: median step, each save's stall, peak memory and its extra over the first mode."""
    base = results[0]["trainer"]
    lines = [
        f"{'mode':<24}{'step s':>8}  {'stall s per save (first, then)':<32}{'trainer GiB':>12}{'extra':>8}"
        f"{'other GiB':>11}  waits s"
    ]
    for r in results:
        stall = ", ".join(f"{v:+.2f}" for _, v in sorted(r["stall_s"].items()))
        waits = ", ".join(f"{w:.1f} ({step_folder(s)})" for s, w in sorted(r["waits_s"].items())) or "-"
        lines.append(
            f"{r['mode']:<24}{r['step_s']:>8.2f}  {stall:<32}{r['trainer']:>12.1f}"
            f"{r['trainer'] - base:>+8.1f}{r['other']:>11.1f}  {waits}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES), help="async modes to run, in order (the first: base)")
    parser.add_argument("--steps", type=int, default=81, help="steps a job (saves after every --interval, not last)")
    parser.add_argument("--interval", type=int, default=40, help="steps between saves: longer than a background write")
    parser.add_argument("--dir", default="/mnt/ckpt/stall", help="where the checkpoints go (emptied after each)")
    parser.add_argument("--out", default="/tmp/stall", help="run folders, logs and stall.json")
    parser.add_argument("--compile", action="store_true", help="per-block compile, as the marin8b configs")
    parser.add_argument("--smoke", action="store_true", help="tiny flavor on CPU: the plumbing, not a figure")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes {args.modes!r}: comma-separated, from {', '.join(MODES)}")
    if args.interval < 1 or args.steps < 2 * args.interval + 1:
        parser.error(f"--steps {args.steps}, --interval {args.interval}: at least two saves before the last step")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, failed = [], []
    for mode in modes:  # a mode that fails is said, and the others still run
        try:
            results.append(
                run_mode(mode, out, Path(args.dir) / mode, args.steps, args.interval, args.smoke, args.compile)
            )
        except (RuntimeError, ValueError, OSError) as e:
            failed.append(f"{mode}: {e}")
            print(f"[{mode}] FAILED: {e}", flush=True)
        # after each mode, so a run cut short keeps the modes it finished
        (out / "stall.json").write_text(json.dumps({"results": results, "failed": failed}, indent=1))
    if results:
        print(table(results))
    if failed:
        sys.exit("failed: " + "; ".join(f.splitlines()[0] for f in failed))


if __name__ == "__main__":
    main()
