"""2-rank FSDP2 training through train_cpt.py on CPU, checkpoint, and exact resume: after a clean
stop, a SIGKILL, a SIGTERM to the launcher (checkpoint, requeue code) and a corrupt newest checkpoint."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, torchrun

from mhar_titan.hf import load_run_checkpoint
from mhar_titan.tensorboard_scalars import LOSS_TAG, read_scalars

# A short schedule whose LR does not depend on how many steps each job runs.
SCHEDULE = ("--lr_scheduler.total_steps", "8", "--lr_scheduler.warmup_steps", "2", "--checkpoint.interval", "4")
SCHEDULE_EVERY_2 = (*SCHEDULE[:4], "--checkpoint.interval", "2")
VALIDATE = ("--validation.freq", "2", "--validation.steps", "2", "--ema.beta", "0.8")
GRAD_NORM_TAG = "grad_norm"


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """8 uninterrupted steps, validating the raw and the EMA weights at steps 2, 4, 6, 8."""
    run = tmp_path_factory.mktemp("straight") / "run"
    proc = torchrun(run, "--training.steps", "8", *SCHEDULE, *VALIDATE)
    log = proc.stdout + proc.stderr
    assert "Applied FSDP to the model" in log
    assert "training on CPU" in log and "with gloo" in log
    return run


def test_resume_reproduces_uninterrupted_run(straight, tmp_path):
    resumed = tmp_path / "resumed"

    # A job that stops after step 4 (time limit, preemption), without validation, and a second
    # job that resumes it: evaluating (and swapping the EMA in and out) must not touch training.
    torchrun(resumed, "--training.steps", "4", *SCHEDULE, *VALIDATE, "--validation.no-enable")
    assert (resumed / "checkpoint" / "step-4").is_dir()
    proc = torchrun(resumed, "--training.steps", "8", *SCHEDULE, *VALIDATE)
    log = proc.stdout + proc.stderr
    assert "Training starts at step 5" in log

    for tag in (LOSS_TAG, GRAD_NORM_TAG, "train/ce", "train/z_loss", "lr/decay", "tokens_seen"):
        want = read_scalars(straight, tag)
        got = read_scalars(resumed, tag)
        assert list(want) == list(range(1, 9)), tag
        assert got == want, f"{tag}: resumed {got} != uninterrupted {want}"
    for tag in ("val/ce", "val/ce_ema"):  # the same fixed set, the same weights: the same values
        want, got = read_scalars(straight, tag), read_scalars(resumed, tag)
        assert list(want) == [2, 4, 6, 8] and list(got) == [6, 8], tag
        assert got == {s: want[s] for s in (6, 8)}, tag
    val, val_ema = read_scalars(straight, "val/ce"), read_scalars(straight, "val/ce_ema")
    assert val_ema[8] != val[8]  # beta 0.8 over 8 steps: the EMA lags the weights
    for ema in (False, True):
        want = load_run_checkpoint(str(straight), 8, ema=ema).state_dict()
        got = load_run_checkpoint(str(resumed), 8, ema=ema).state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want), f"ema={ema}: weights differ after resume"

    losses = read_scalars(straight)
    assert min(losses.values()) < losses[1] - 1.0, losses


def test_resume_on_another_number_of_ranks_continues_every_data_stream(tmp_path):
    import pickle

    import torch.distributed.checkpoint as dcp

    run = tmp_path / "run"
    torchrun(run, "--training.steps", "4", *SCHEDULE)  # 2 ranks, 2 streams each
    proc = torchrun(run, "--training.steps", "6", *SCHEDULE, nproc=1)  # 1 rank, all 4 streams
    assert "Training starts at step 5" in proc.stdout + proc.stderr
    assert list(read_scalars(run)) == [1, 2, 3, 4, 5, 6]

    def streams(step):
        keys = {f"dataloader.stream_{s:05d}": None for s in range(4)} | {"dataloader.batches": None}
        dcp.load(keys, checkpoint_id=str(run / "checkpoint" / f"step-{step}"), no_dist=True)
        return keys["dataloader.batches"], {k: pickle.loads(v) for k, v in keys.items() if "stream" in k}

    batches4, at4 = streams(4)
    batches6, at6 = streams(6)
    assert (batches4, batches6) == (4, 6)
    # steps 5 and 6 on one rank took batches 4 and 5: streams 0 and 1, one batch each
    assert [at6[k]["batches"] - at4[k]["batches"] for k in sorted(at4)] == [1, 1, 0, 0]


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (torchrun starts each worker in a session of its own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def launch_until(run: Path, pattern: str | None, action) -> tuple[int, str]:
    """launch/torchrun.sh on 2 ranks; when a line contains `pattern`, call action(launcher pid)."""
    cmd = [str(REPO / "launch" / "torchrun.sh"), "--nproc", "2", "configs/tiny_cpu.toml"]
    cmd += ["--job.dump_folder", str(run), "--training.steps", "8", *SCHEDULE_EVERY_2, *VALIDATE]
    env = {**os.environ, "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if pattern is not None and pattern in line:
            action(proc.pid)
            pattern = None
    return proc.wait(timeout=600), "".join(lines)


def kill_everything(pid: int) -> None:
    for p in process_tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_killed_preempted_and_corrupted_runs_resume_to_the_same_losses(straight, tmp_path):
    run = tmp_path / "run"
    ckpt = run / "checkpoint"

    # 1. The machine dies after step 5: checkpoints 2 and 4 are complete.
    launch_until(run, "step 5/8", kill_everything)
    assert (ckpt / "step-4" / ".metadata").is_file()

    # 2. Restarted, then preempted after step 6: the launcher's SIGTERM becomes a checkpoint at the
    #    next step boundary and the requeue exit code.
    rc, log = launch_until(run, "step 6/8", lambda pid: os.kill(pid, signal.SIGTERM))
    assert "Training starts at step 5" in log
    assert rc == 75, log[-3000:]
    stop = json.loads((run / "preempted.json").read_text())["step"]
    assert stop in (6, 7) and (ckpt / f"step-{stop}" / ".metadata").is_file()
    assert not (run / "STOP").exists()

    # 3. The newest checkpoint is damaged (a truncated shard): the restart falls back and says so.
    for shard in (ckpt / f"step-{stop}").glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    previous = max(int(p.name[5:]) for p in ckpt.glob("step-*") if int(p.name[5:]) < stop)
    rc, log = launch_until(run, None, None)
    assert rc == 0, log[-3000:]
    assert f"falling back to step {previous}" in log
    assert f"Training starts at step {previous + 1}" in log

    for tag in (LOSS_TAG, GRAD_NORM_TAG, "val/ce", "val/ce_ema"):
        want, got = read_scalars(straight, tag), read_scalars(run, tag)
        assert got == want, f"{tag}: {got} != uninterrupted {want}"
