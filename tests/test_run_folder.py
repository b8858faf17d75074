"""The run folder, in one process: one job per folder (the lock's verdicts for a live holder, a gone
holder, a requeue of the same SLURM job, the same launch; takeover, release, a lock lost to a
takeover), the STOP file told apart by the launch id written in it, the schedule a resume applies,
and a checkpoint folder that cannot be written or is full, at start and at a save."""

import errno
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from mhar_titan.components.checkpoint import space
from mhar_titan.components.hooks import Hooks
from mhar_titan.components.lr_schedule import apply_settings, build_lr_schedulers
from mhar_titan.components.optimizer import group_settings
from mhar_titan.components.preemption import STOP_FILE, PreemptionWatch
from mhar_titan.components.run_folder import RunFolderLock
from mhar_titan.components.run_lock import LOCK_FILE, LockHeld, RunLock, acquire_everywhere
from mhar_titan.config import parse_config
from mhar_titan.trainer import CPTTrainer


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def lock(folder, clock, *, host="node-a", pid=None, launch="launch-a", job="", stale=300.0, wait=0.0) -> RunLock:
    me = {"host": host, "pid": pid or os.getpid(), "pid_start": None, "launch_id": launch, "slurm_job_id": job}
    return RunLock(str(folder), stale, wait, clock=clock, sleep=clock.sleep, me=me)


def test_a_live_holder_refuses_a_second_job_and_a_gone_one_is_taken_over(tmp_path):
    clock = Clock()
    first = lock(tmp_path, clock)
    assert "this job holds the run folder" in first.acquire()
    record = json.loads((tmp_path / LOCK_FILE).read_text())
    assert (record["host"], record["launch_id"], record["beats"]) == ("node-a", "launch-a", 1)

    second = lock(tmp_path, clock, host="node-b", launch="launch-b")
    clock.now += 299
    with pytest.raises(
        LockHeld, match=r"in use by another job \(host node-a, pid \d+, launch launch-a, last heartbeat 299 s"
    ):
        second.acquire()
    first.heartbeat()  # the live job's heartbeat keeps it fresh
    clock.now += 299
    with pytest.raises(LockHeld):
        second.acquire()
    assert not first.lost

    clock.now += 2  # 301 s without a heartbeat: that job is gone
    line = second.acquire()
    assert "took over a lock whose job is gone: its heartbeat is 301 s old" in line, line
    assert json.loads((tmp_path / LOCK_FILE).read_text())["launch_id"] == "launch-b"
    assert sorted(os.listdir(tmp_path)) == [LOCK_FILE]  # nothing set aside is left behind
    first.heartbeat()  # the old holder, back from a stall, writes into the file set aside, not the new lock
    assert first.lost
    assert json.loads((tmp_path / LOCK_FILE).read_text())["launch_id"] == "launch-b"
    first.release()  # not its lock any more: left alone
    assert (tmp_path / LOCK_FILE).exists()
    second.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_holder_whose_process_is_gone_on_this_host_is_taken_over_at_once(tmp_path):
    clock = Clock()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock(tmp_path, clock, pid=dead.pid, launch="killed").acquire()  # a job killed with SIGKILL left this
    line = lock(tmp_path, clock, launch="next").acquire()
    assert f"its process is gone: host node-a, pid {dead.pid}" in line
    # on another host a live heartbeat is all there is to go by, whatever the launch
    with pytest.raises(LockHeld):
        lock(tmp_path, clock, host="node-c", launch="next").acquire()


def test_a_requeued_slurm_job_waits_for_its_earlier_run_and_then_gives_up(tmp_path):
    clock = Clock()
    old = lock(tmp_path, clock, host="node-a", launch="slurm-77-0", job="77")
    old.acquire()
    requeued = lock(tmp_path, clock, host="node-b", launch="slurm-77-1", job="77", wait=60)
    began = clock.now
    with pytest.raises(LockHeld, match=r"an earlier run of this SLURM job still holds it .* waited 60 s"):
        requeued.acquire()
    assert 60 <= clock.now - began <= 66  # polled, then refused once the wait was spent

    polls = []

    def release_after_three(seconds):
        polls.append(seconds)
        clock.sleep(seconds)
        if len(polls) == 3:
            old.release()

    requeued.sleep = release_after_three
    assert "this job holds the run folder" in requeued.acquire()
    assert len(polls) == 3
    other = lock(tmp_path, clock, host="node-c", launch="slurm-78-0", job="78", wait=60)
    with pytest.raises(LockHeld, match="in use by another job"):  # another job never waits
        other.acquire()


def test_every_rank_follows_rank_0s_verdict(tmp_path):
    clock = Clock()
    holder = lock(tmp_path, clock, host="node-a")
    holder.acquire()
    answers = []

    def share(compute):  # rank 0 computes; the answer is what every rank sees
        answers.append(compute())
        return answers[-1]

    with pytest.raises(LockHeld, match="in use by another job"):
        acquire_everywhere(lock(tmp_path, clock, host="node-b", launch="b"), share)
    assert answers[-1]["kind"] == "refuse"
    with pytest.raises(LockHeld, match="in use by another job"):  # a rank without the lock raises the same
        acquire_everywhere(None, lambda compute: answers[-1])


def test_the_heartbeat_thread_refreshes_the_lock_and_release_removes_it(tmp_path):
    held = RunLock(str(tmp_path), stale_after=2.0, wait=0.0)
    held.acquire()
    first = json.loads((tmp_path / LOCK_FILE).read_text())["heartbeat"]
    deadline = time.time() + 10
    while json.loads((tmp_path / LOCK_FILE).read_text())["heartbeat"] == first and time.time() < deadline:
        time.sleep(0.05)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["heartbeat"] > first
    held.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_stop_file_is_told_apart_by_the_launch_written_in_it(tmp_path, own_signal_handlers):
    stop = tmp_path / STOP_FILE
    watch = PreemptionWatch(str(tmp_path), launch_id="host-1-42")
    stop.write_text("host-1-42\n")  # this launch's launcher, signalled before the trainer started
    old = time.time() - 3600
    os.utime(stop, (old, old))  # its age does not matter
    watch.clear_stale_marker()
    assert stop.exists() and watch.local_request() == "stop file"

    stop.write_text("host-1-7\n")  # an earlier launch's, left by a job killed before its trainer saw it
    assert watch.local_request() is None  # during the run: ignored
    watch.clear_stale_marker()  # at start: removed
    assert not stop.exists()

    stop.touch()  # by hand, while this job runs
    assert watch.local_request() == "stop file"


def schedulers(lr: float, weight_decay: float, warmup: int):
    job = parse_config(
        [
            *("--job.config_file", "configs/tiny_cpu.toml"),
            *("--optimizer.lr", str(lr), "--optimizer.weight_decay", str(weight_decay)),
            *("--lr_scheduler.warmup_steps", str(warmup), "--lr_scheduler.total_steps", "20"),
        ]
    )
    kwargs = {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": weight_decay}
    settings = group_settings(kwargs, lr_multiplier=2.0)
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    groups = [{"params": [p], "name": name, **settings[name]} for p, name in zip(params, settings, strict=True)]
    optimizers = [torch.optim.AdamW(groups, **kwargs)]  # what the container iterates over
    return build_lr_schedulers(optimizers, job.lr_scheduler, 20), settings


def test_a_resume_applies_the_configs_schedule_from_its_first_step():
    old, _ = schedulers(3e-3, 0.05, warmup=2)
    for _ in range(6):
        old.step()
    saved = {"scheduler": old.state_dict(), "optimizer": old.schedulers[0].optimizer.state_dict()}

    same, settings = schedulers(3e-3, 0.05, warmup=2)
    same.schedulers[0].optimizer.load_state_dict(saved["optimizer"])
    same.load_state_dict(saved["scheduler"])
    before = [dict(g, params=None) for g in same.schedulers[0].optimizer.param_groups]
    assert apply_settings(same, settings) == []  # nothing changed: the same values, bit for bit
    assert [dict(g, params=None) for g in same.schedulers[0].optimizer.param_groups] == before

    new, settings = schedulers(1e-3, 0.1, warmup=8)
    new.schedulers[0].optimizer.load_state_dict(saved["optimizer"])
    new.load_state_dict(saved["scheduler"])
    lines = apply_settings(new, settings)
    groups = {g["name"]: g for g in new.schedulers[0].optimizer.param_groups}
    assert groups["decay"]["lr"] == 1e-3 * (6 / 8) and groups["routing"]["lr"] == 2e-3 * (6 / 8)  # warmup 8, step 7
    assert (groups["decay"]["weight_decay"], groups["no_decay"]["weight_decay"]) == (0.1, 0.0)
    scheduler: LambdaLR = new.schedulers[0]
    assert scheduler.base_lrs == [1e-3, 1e-3, 2e-3] and scheduler.get_last_lr() == [g["lr"] for g in groups.values()]
    assert lines[0].startswith("optimizer group decay: peak lr 0.003 -> 0.001, weight_decay 0.05 -> 0.1, lr of step 7")
    new.step()  # the schedule goes on from the new values
    assert groups["decay"]["lr"] == 1e-3 * (7 / 8)


def test_a_checkpoint_folder_that_cannot_be_made_or_has_no_room_is_refused_naming_the_sizes(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the run's folder should be")
    with pytest.raises(OSError, match=rf"checkpoint folder {blocker}/checkpoint is not writable \(NotADirectoryError"):
        space.check_checkpoint_folder(str(blocker / "checkpoint"), 1)
    folder = tmp_path / "run" / "checkpoint"
    space.check_checkpoint_folder(str(folder), 1)  # made, written to, room
    assert folder.is_dir() and not list(folder.iterdir())  # the probe is gone
    usage = shutil.disk_usage(folder)
    monkeypatch.setattr(space.shutil, "disk_usage", lambda path: usage._replace(free=3 * 2**30))
    with pytest.raises(OSError, match=r": 3.00 GiB free, one checkpoint of this run takes about 128.00 GiB"):
        space.check_checkpoint_folder(str(folder), 128 * 2**30)


def test_a_save_that_fails_on_a_full_disk_says_so_and_any_other_failure_is_left_as_it_is(tmp_path, monkeypatch):
    step = tmp_path / "checkpoint" / "step-40"  # DCP had begun the folder
    step.mkdir(parents=True)
    torch_says = RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 2240 vs 2134")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(space.shutil, "disk_usage", lambda path: usage._replace(free=2**20))
    told = space.save_failure(str(step), 128 * 2**30, torch_says)
    assert isinstance(told, OSError) and told.errno == errno.ENOSPC
    assert f"checkpoint {step} could not be written: No space left on device (0.00 GiB free, a checkpoint" in str(told)
    assert "unexpected pos 2240 vs 2134" in str(told)  # torch's own words kept
    monkeypatch.setattr(space.shutil, "disk_usage", lambda path: usage._replace(free=2**40))
    other = RuntimeError("a rank could not reach the store")
    assert space.save_failure(str(step), 128 * 2**30, other) is other
    nospace = OSError(errno.ENOSPC, "No space left on device")  # a quota: room on the disk, none for us
    assert space.save_failure(str(tmp_path / "gone" / "step-8"), 1, nospace) is not nospace


def test_a_checkpoint_takes_weights_two_moments_and_the_fp32_ema():
    model = torch.nn.Linear(10, 10)  # 110 parameters in fp32
    assert space.checkpoint_bytes(model, ema=True) == 110 * (3 * 4 + 4)
    assert space.checkpoint_bytes(model.to(torch.bfloat16), ema=False) == 110 * 3 * 2


def test_the_run_lock_is_released_even_when_closing_fails(tmp_path):
    """A background save that failed as the job closed fails the job; its lock must not outlive it."""

    class Closing:
        def close(self):
            raise OSError("the background save failed")

    job, held = CPTTrainer.__new__(CPTTrainer), RunFolderLock()
    job.checkpointer, job.hooks = Closing(), Hooks([held])
    held.lock = lock(tmp_path, Clock())
    held.lock.acquire()
    with pytest.raises(OSError, match="the background save failed"):
        job.close()
    assert not (tmp_path / LOCK_FILE).exists()
