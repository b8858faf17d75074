"""The preflight's pair, as a user runs it: each arm from the base through launch/torchrun.sh, a checkpoint
midway, the job SIGKILLed a few steps after it (its process group, as a scheduler kills a job), relaunched from
that checkpoint twice with the same command, and the resumed steps compared with what the killed job had logged.
The first relaunch (the rerun) is killed at the same step as the first job; the second trains to the end. On GPUs
whose kernels are not repeatable bit for bit the two relaunches measure this job's own run-to-run spread on the
very steps compared (verdicts.resume_verdict); where they are, any difference is a failure.

A job's scalars are read right after it ends: the next relaunch purges the lost timeline's events past its
checkpoint (the TensorBoard run stays one timeline), so afterwards only the relaunch's values are there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from data.loader import check_stages, data_config
from data.mixture import parse_mixture
from mhar_titan.components.checkpoint.layout import FOLDER, complete_steps, step_folder
from mhar_titan.components.tensorboard_scalars import load_scalars

REPO = Path(__file__).resolve().parents[2]
LOGGED_STEP = re.compile(r"step (\d+)/\d+\s+loss")
RESUMED_FROM = re.compile(r"resumes from its checkpoint .*\(step (\d+)\)")
VALIDATED = "validation at step {}:"

Scalars = dict[str, dict[int, float]]


class JobFailed(RuntimeError):
    """A job of the pair that did not do what the preflight needs: one line naming the arm, the job and its log."""


@dataclasses.dataclass
class PairSettings:
    steps: int  # per arm
    checkpoint_at: int
    kill_after: int  # the killed job is SIGKILLed once it has logged this step
    nproc: int
    pair: Path  # runs/preflight/<timestamp>/pair
    logs: Path
    python: str
    timeout_s: float = 1800.0


def moved_stages(job_config: Any, s: PairSettings) -> tuple[list[str], str]:
    """The configs' mixture stages moved into the preflight's steps (their weights kept), between the midway
    checkpoint and the kill, so that the killed job and its relaunch both cross a boundary: (the override, a
    note for the report); nothing without stages."""
    schedule = check_stages(job_config)
    if not schedule.staged:
        return [], ""
    names = [src.name for src in parse_mixture(data_config(job_config))]
    later = schedule.stages[1:]
    span = s.kill_after - s.checkpoint_at
    starts = [s.checkpoint_at + 1 + (j + 1) * span // (len(later) + 1) for j in range(len(later))]
    entries = [
        f"{start}: " + " ".join(f"{n}={w!r}" for n, w in zip(names, st.weights, strict=True))
        for start, st in zip(starts, later, strict=True)
    ]
    moved = ", ".join(f"{st.start} -> {start}" for start, st in zip(starts, later, strict=True))
    return ["--data.mixture_stages", ",".join(entries)], f"mixture stages moved to this run's steps ({moved})"


def job_command(config: str, arm: str, launch_id: str, s: PairSettings, overrides: list[str]) -> list[str]:
    return [
        "bash",
        str(REPO / "launch" / "torchrun.sh"),
        "--nproc",
        str(s.nproc),
        "--launch-id",
        launch_id,
        config,
        *overrides,
        "--job.dump_folder",
        str(s.pair / arm),
    ]


def _env(python: str) -> dict[str, str]:
    return {**os.environ, "PYTHON": python, "HF_HUB_OFFLINE": "1"}


def last_logged_step(log: Path) -> int:
    steps = [int(m[1]) for m in LOGGED_STEP.finditer(log.read_text(errors="replace"))] if log.exists() else []
    return max(steps, default=0)


def _error_line(log: Path) -> str:
    """The log's own error line, if the job wrote one (refusals are one line), else its last line."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    errors = [line for line in lines if " - ERROR - " in line or "Error:" in line]
    return (errors or lines or ["(empty log)"])[-1].strip()[-300:]


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_killed(
    config: str, arm: str, s: PairSettings, overrides: list[str], rerun: bool = False, name: str | None = None
) -> dict[str, Any]:
    """The first job: trains past the checkpoint, validates at s.kill_after, then its launcher's process group gets
    SIGKILL. With `rerun`, a relaunch: it must resume from the checkpoint, and is killed at the same point. Its log
    and scalars go to logs/<arm>-<name>.log and -scalars.json (name: killed or rerun unless given)."""
    launch = 2 if rerun else 1
    name = name or ("rerun" if rerun else "killed")
    log = s.logs / f"{arm}-{name}.log"
    cmd = job_command(config, arm, f"preflight-{arm}-{launch}", s, overrides)
    began = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(s.python), start_new_session=True)
    folder = str(s.pair / arm / FOLDER)
    job = "the rerun from the checkpoint" if rerun else "the first job"
    try:
        while True:
            time.sleep(0.25)
            if proc.poll() is not None:
                raise JobFailed(
                    f"{arm}: {job} exited ({proc.returncode}) at step {last_logged_step(log)} before it could "
                    f"be killed after step {s.kill_after}: {_error_line(log)} (log: {log})"
                )
            if time.monotonic() - began > s.timeout_s:
                raise JobFailed(f"{arm}: {job} did not reach step {s.kill_after} in {s.timeout_s:.0f} s (log: {log})")
            step = last_logged_step(log)
            if (
                step >= s.kill_after
                and VALIDATED.format(s.kill_after) in log.read_text(errors="replace")
                and s.checkpoint_at in complete_steps(folder)
            ):
                break
    finally:
        _kill_group(proc)
    if rerun:
        _check_resumed(arm, log, s)
    seconds = time.monotonic() - began
    scalars = load_scalars(s.pair / arm)
    (s.logs / f"{arm}-{name}-scalars.json").write_text(json.dumps(scalars))
    return {
        "seconds": seconds,
        "killed_at": max(scalars.get("train/loss", {0: 0})),
        "scalars": scalars,
        "log": str(log),
    }


def _check_resumed(arm: str, log: Path, s: PairSettings) -> None:
    resumed = [int(m[1]) for m in RESUMED_FROM.finditer(log.read_text(errors="replace"))]
    if resumed != [s.checkpoint_at]:
        raise JobFailed(
            f"{arm}: the relaunch did not resume from the step-{s.checkpoint_at} checkpoint "
            f"(its log says {resumed or 'no resume'}; log: {log})"
        )


def run_resumed(
    config: str, arm: str, s: PairSettings, overrides: list[str], drop_loaded: bool, resumes: bool = True
) -> dict[str, Any]:
    """The relaunch: the same command; it must resume from the checkpoint and train to the last step. With
    `drop_loaded`, the checkpoint it resumed from is deleted once it has started training (it is never read again):
    the scratch disk then holds one checkpoint of the arm at a time, and the one being written. With `resumes`
    false, the arm's one uninterrupted job, which must start from the base."""
    log = s.logs / f"{arm}-{'resumed' if resumes else 'uninterrupted'}.log"
    cmd = job_command(config, arm, f"preflight-{arm}-{3 if resumes else 1}", s, overrides)
    began = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(s.python), start_new_session=True)
    loaded = s.pair / arm / FOLDER / step_folder(s.checkpoint_at)
    started = f"Training starts at step {s.checkpoint_at + 1}"
    try:
        while (code := proc.poll()) is None:
            time.sleep(0.25)
            if time.monotonic() - began > s.timeout_s:
                raise JobFailed(f"{arm}: the resumed job did not finish in {s.timeout_s:.0f} s (log: {log})")
            if drop_loaded and loaded.exists() and started in log.read_text(errors="replace"):
                shutil.rmtree(loaded)
    finally:
        if proc.poll() is None:
            _kill_group(proc)
    seconds = time.monotonic() - began
    if code != 0:
        raise JobFailed(f"{arm}: the resumed job exited {code}: {_error_line(log)} (log: {log})")
    text = log.read_text(errors="replace")
    if not resumes:
        if RESUMED_FROM.search(text) or "Training starts at step 1\n" not in text:
            raise JobFailed(f"{arm}: the job did not start from the base at step 1 (log: {log})")
    else:
        _check_resumed(arm, log, s)
    return {"seconds": seconds, "scalars": load_scalars(s.pair / arm), "log": str(log)}


def harmonic_rate(series: dict[int, float], first: int, last: int) -> float | None:
    """Tokens over time across steps first..last (periodic work such as the EMA counts at its real share)."""
    values = [v for s, v in series.items() if first <= s <= last and v > 0]
    return len(values) / sum(1 / v for v in values) if values else None


def gates_moved(scalars: Scalars) -> float | None:
    """The largest |gate| of any routing site at the last step the MHAR arm logged its routing statistics."""
    gates = {t: v for t, v in scalars.items() if re.fullmatch(r"mhar_(attn|ffn)_gate/layer\d+", t) and v}
    if not gates:
        return None
    last = max(max(v) for v in gates.values())
    return max(abs(v[last]) for v in gates.values() if last in v)
