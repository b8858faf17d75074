"""The launchers under a real Slurm (tests/slurm_cluster.py: Debian's 22.05 daemons on this machine, its CPUs, no
GPU): the tiny pair through `launch/pair.sh --slurm`; an arm that the time-limit warning and a requeue each stop
with a checkpoint, and one that a crash and a hang each end, each coming back twice and ending with every logged
value of the pair's uninterrupted control arm.

Skipped without root or without the packages, failed instead where MHAR_REQUIRE_SLURM=1 (`.ci/run` sets it)."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO
from slurm_cluster import REQUIRE_ENV, SlurmCluster, unavailable

from mhar_titan.components.checkpoint.testing import CRASH_ENV, HANG_ENV
from mhar_titan.components.endings import read_endings
from mhar_titan.components.tensorboard_scalars import LOSS_TAG, read_scalars

CONTROL, MHAR = "configs/tiny_cpu.toml", "configs/tiny_cpu_mhar.toml"
# 8 steps, a checkpoint every 2, validation of the raw and EMA weights every 2 (as tests/test_train_resume.py)
ARM = (
    *("--training.steps", "8", "--lr_scheduler.total_steps", "8", "--lr_scheduler.warmup_steps", "2"),
    *("--checkpoint.interval", "2", "--validation.freq", "2", "--validation.steps", "1", "--ema.beta", "0.8"),
)
TAGS = (LOSS_TAG, "grad_norm", "val/ce", "val/ce_ema", "lr/decay", "tokens_seen")
STEP_LINE = "/8  loss"  # the log line of each step
JOB_ENV = {"PYTHON": sys.executable, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = unavailable()
    if reason is not None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {reason}")
        pytest.skip(f"{reason}; set up by .ci/run")
    slurm = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        slurm.start()
        yield slurm
    finally:
        slurm.stop()


@pytest.fixture(scope="module")
def pair(cluster, tmp_path_factory):
    """The tiny pair submitted by launch/pair.sh --slurm on CPU nodes, both arms run to their end."""
    runs, name = tmp_path_factory.mktemp("runs"), f"slurm{os.getpid()}"
    env = {**cluster.env, **JOB_ENV, "RUNS_DIR": str(runs), "SBATCH_ARGS": "--gpus-per-node=0"}
    done = subprocess.run(
        ["launch/pair.sh", "--slurm", name, CONTROL, MHAR, *ARM], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    jobs = [int(j) for j in re.findall(r"Submitted batch job (\d+)", done.stdout)]
    assert len(jobs) == 2, done.stdout + done.stderr
    logs = [REPO / "logs" / f"{name}-{arm}-{job}.out" for arm, job in zip(("control", "mhar"), jobs, strict=True)]
    try:
        ended = [cluster.wait(job) for job in jobs]
        texts = [log.read_text() if log.exists() else "(no log)" for log in logs]
    finally:
        for log in logs:
            log.unlink(missing_ok=True)
    return runs / name, ended, texts


def test_the_tiny_pair_runs_to_its_end_through_pair_sh_and_real_sbatch(pair):
    runs, ended, logs = pair
    for arm, fields, log in zip(("control", "mhar"), ended, logs, strict=True):
        assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "0"), log[-3000:]
        assert "step 8/8" in log and "Traceback" not in log
        assert sorted(read_scalars(runs / arm, LOSS_TAG)) == list(range(1, 9))
    assert read_scalars(runs / "control", LOSS_TAG) != read_scalars(runs / "mhar", LOSS_TAG)


def wait_for_line(cluster: SlurmCluster, job: int, log: Path, pattern: str, count: int = 1) -> None:
    """Until `pattern` appears `count` times in the job's log (appended over its restarts)."""
    deadline = time.monotonic() + 300
    while not (log.exists() and log.read_text().count(pattern) >= count):
        cluster.kick(job)
        assert time.monotonic() < deadline, f"{pattern!r} x{count} not in {log} after 300 s"
        time.sleep(0.1)


def test_a_warning_and_a_requeue_each_checkpoint_and_the_arm_resumes_to_the_uninterrupted_values(
    cluster, pair, tmp_path
):
    """The time-limit warning (USR1 to the batch shell: the script requeues) and `scontrol requeue` (SIGTERM to
    every process of the job: Slurm requeues) each end a run of the job with a checkpoint and exit 75; the job
    comes back twice and ends with the values of the arm that was never stopped."""
    runs, _, _ = pair
    run, log = tmp_path / "control", tmp_path / "job.out"
    job = cluster.sbatch(
        f"--output={log}",
        "--gpus-per-node=0",
        *("launch/slurm.sbatch", CONTROL, "--job.dump_folder", str(run), *ARM),
        cwd=REPO,
        env=JOB_ENV,
    )
    wait_for_line(cluster, job, log, "step 2/8")  # the first run's second step
    cluster.run("scancel", "--signal=USR1", "--batch", str(job))
    wait_for_line(cluster, job, log, "Training starts at step", 2)  # requeued by the script, started again
    wait_for_line(cluster, job, log, STEP_LINE, log.read_text().count(STEP_LINE) + 2)  # two steps into the run
    cluster.run("scontrol", "requeue", str(job))
    fields = cluster.wait(job)
    text = log.read_text()
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "2"), text[-4000:]
    assert "got SIGUSR1; asking the trainer to checkpoint and stop" in text
    assert "the trainer checkpointed and stopped; scontrol requeue" in text
    assert "got SIGTERM; passed to the 2 workers" in text  # torchrun got the cluster's SIGTERM too
    assert text.count("exiting 75 to be requeued") == 2 and text.count("Training starts at step") == 3
    assert not any(s in text for s in ("death signal", "Traceback", "SignalException"))
    for tag in TAGS:
        assert read_scalars(run, tag) == read_scalars(runs / "control", tag), tag


def test_a_crash_and_a_hang_are_each_requeued_and_the_arm_resumes_to_the_uninterrupted_values(cluster, pair, tmp_path):
    """Rank 1 raises after step 3 (once), later a rank stops for good in step 6's collective (once): slurm.sbatch
    records each ending and requeues the job ([job] restart_backoff_s 0), which resumes from its last checkpoint
    and ends with the values of the arm that was never stopped."""
    runs, _, _ = pair
    run, log = tmp_path / "control", tmp_path / "job.out"
    faults = {CRASH_ENV: "3:once", HANG_ENV: "6:collective:once"}
    job = cluster.sbatch(
        f"--output={log}",
        "--gpus-per-node=0",
        *("launch/slurm.sbatch", CONTROL, "--job.dump_folder", str(run), *ARM),
        *("--job.restart_backoff_s", "0", "--watchdog.floor_s", "10", "--watchdog.factor", "2"),
        cwd=REPO,
        env={**JOB_ENV, **faults},
    )
    fields = cluster.wait(job)
    text = log.read_text()
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "2"), text[-4000:]
    assert "crashed (exit 1) at step 3, rank 1: RuntimeError: TEST CRASH" in text
    assert "hung (exit 124) at step 6, rank " in text and "restart 2 of 3 in 0 s" in text
    assert text.count("scontrol requeue") >= 2 and text.count("Training starts at step") == 3
    ended = [(e["class"], e["step"]) for e in read_endings(str(run))]
    assert ended == [("crashed", 3), ("hung", 6), ("finished", 8)]
    for tag in TAGS:
        assert read_scalars(run, tag) == read_scalars(runs / "control", tag), tag
