"""2-rank FSDP2 training through train_cpt.py on CPU, checkpoint, and exact resume: after a clean
stop, a SIGKILL, a SIGTERM to the launcher (checkpoint, requeue code), a SIGTERM while a background
save writes, a flipped bit in the newest checkpoint and on another number of ranks; crafted
checkpoints and other architectures refused."""

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO, process_tree, torchrun
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from mhar_titan.components.checkpoint.checksums import verify_share
from mhar_titan.components.checkpoint.layout import MANIFEST_DIR, complete_steps, temporary_steps
from mhar_titan.components.checkpoint.testing import CRASH_ENV
from mhar_titan.components.checkpoint.testing import HOLD_SAVE_ENV as HOLD_SAVE
from mhar_titan.components.compute_clock import STATE as CLOCK_STATE
from mhar_titan.components.endings import read_endings
from mhar_titan.components.tensorboard_scalars import LOSS_TAG, RESTARTS_TAG, read_scalars
from mhar_titan.config import parse_config
from mhar_titan.hf.run import load_run_checkpoint

# A short schedule whose LR does not depend on how many steps each job runs; spikes scored from step 4.
SCHEDULE = (
    *("--lr_scheduler.total_steps", "8", "--lr_scheduler.warmup_steps", "2", "--checkpoint.interval", "4"),
    *("--spikes.window", "4", "--spikes.min_history", "3"),
)
SCHEDULE_EVERY_2 = (*SCHEDULE[:4], "--checkpoint.interval", "2", *SCHEDULE[6:])
SPIKE_SCORES = ("spikes/loss_score", "spikes/grad_norm_score")
VALIDATE = ("--validation.freq", "2", "--validation.steps", "1", "--ema.beta", "0.8")
GRAD_NORM_TAG = "grad_norm"


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """8 uninterrupted steps, validating the raw and the EMA weights at steps 0 (the base), 2, 4, 6, 8."""
    run = tmp_path_factory.mktemp("straight") / "run"
    proc = torchrun(run, "--training.steps", "8", *SCHEDULE, *VALIDATE)
    log = proc.stdout + proc.stderr
    assert "Applied FSDP to the model" in log
    assert "training on CPU" in log and "with gloo" in log
    return run


@pytest.fixture(scope="module")
def first_half(tmp_path_factory) -> Path:
    """A job that stops after step 4 (time limit, preemption), without validation; each test resumes a copy."""
    run = tmp_path_factory.mktemp("first_half") / "run"
    torchrun(run, "--training.steps", "4", *SCHEDULE, *VALIDATE, "--validation.no-enable")  # 2 ranks, 2 streams each
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["step-4"]
    return run


def test_resume_reproduces_uninterrupted_run(straight, first_half, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(first_half, resumed)

    # The job that resumes the first half: evaluating (and swapping the EMA in and out) must not touch training.
    proc = torchrun(resumed, "--training.steps", "8", *SCHEDULE, *VALIDATE)
    log = proc.stdout + proc.stderr
    assert "Training starts at step 5" in log
    # the log line: seconds a step, the tokens seen (all ranks, counted across the resume) and the share done
    assert re.search(r"step 8/8 .* [0-9.]+ s/step  tokens 16,384 \(100\.0%\)", log), log[-2000:]

    for tag in (LOSS_TAG, GRAD_NORM_TAG, "train/ce", "train/z_loss", "lr/decay", "tokens_seen"):
        want = read_scalars(straight, tag)
        got = read_scalars(resumed, tag)
        assert list(want) == list(range(1, 9)), tag
        assert got == want, f"{tag}: resumed {got} != uninterrupted {want}"
    for tag in SPIKE_SCORES:  # scored against the windows the checkpoint kept
        want, got = read_scalars(straight, tag), read_scalars(resumed, tag)
        assert list(want) == list(range(4, 9)) and got == want, tag
    # the LR logged at a step is the one that step applied: 0 for the first (cold start, warmup 2), then the peak
    lr = read_scalars(straight, "lr/decay")
    peak = parse_config(["--job.config_file", str(REPO / "configs" / "tiny_cpu.toml")]).optimizer.lr
    assert lr[1] == 0.0 and abs(lr[2] - peak / 2) <= 1e-6 * peak and abs(lr[3] - peak) <= 1e-6 * peak, lr
    for tag in ("val/ce", "val/ce_ema"):  # the same fixed set, the same weights: the same values
        want, got = read_scalars(straight, tag), read_scalars(resumed, tag)
        # a fresh start validates the base at step 0 too; a resume does not repeat it, but validates its own step,
        # a validation step that no job validated (the first half ran without validation)
        assert list(want) == [0, 2, 4, 6, 8] and list(got) == [4, 6, 8], tag
        assert got == {s: want[s] for s in (4, 6, 8)}, tag
    assert "validation at step 4: no job validated it" in log
    files = {run: sorted(p.name for p in (run / "validation").glob("step-*.json")) for run in (straight, resumed)}
    assert files[straight] == [f"step-{s:08d}.json" for s in (0, 2, 4, 6, 8)]
    assert files[resumed] == [f"step-{s:08d}.json" for s in (4, 6, 8)]
    val, val_ema = read_scalars(straight, "val/ce"), read_scalars(straight, "val/ce_ema")
    assert val_ema[0] == val[0]  # at step 0 the EMA is the weights
    assert val_ema[8] != val[8]  # beta 0.8 over 8 steps: the EMA lags the weights
    for ema in (False, True):
        want = load_run_checkpoint(str(straight), 8, ema=ema).state_dict()
        got = load_run_checkpoint(str(resumed), 8, ema=ema).state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want), f"ema={ema}: weights differ after resume"

    losses = read_scalars(straight)
    assert min(losses.values()) < losses[1] - 1.0, losses


def test_resume_on_another_number_of_ranks_continues_every_data_stream_and_count(straight, first_half, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(first_half, run)
    # 1 rank, all 4 streams, the same global batch (2 microbatches of 4 sequences a step)
    batch = ("--training.global_batch_size", "8")
    proc = torchrun(run, "--training.steps", "6", *SCHEDULE, *VALIDATE, "--validation.no-enable", *batch, nproc=1)
    assert "Training starts at step 5" in proc.stdout + proc.stderr
    assert list(read_scalars(run)) == [1, 2, 3, 4, 5, 6]
    want = read_scalars(straight, "tokens_seen")
    assert read_scalars(run, "tokens_seen") == {s: want[s] for s in range(1, 7)}

    def streams(step):
        keys = {"dataloader": {f"stream_{s:05d}": "" for s in range(4)} | {"batches": 0}}
        dcp.load(keys, checkpoint_id=str(run / "checkpoint" / f"step-{step}"), no_dist=True)
        loader = keys["dataloader"]
        return loader["batches"], {k: json.loads(v) for k, v in loader.items() if k.startswith("stream")}

    batches4, at4 = streams(4)
    batches6, at6 = streams(6)
    assert (batches4, batches6) == (4, 12)  # one rank takes 2 batches a step: its counter is 6 x 2 at step 6
    # steps 5 and 6 on one rank took batches 4 to 7: streams 0, 1, 2 and 3, one batch (4 windows) each
    assert [at6[k]["windows"] - at4[k]["windows"] for k in sorted(at4)] == [4, 4, 4, 4]


class Payload:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_checkpoint_entries_run_no_code_and_every_rank_falls_back_together(straight, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    everything = tmp_path / "step-8.pt"
    dcp_to_torch_save(str(run / "checkpoint" / "step-8"), str(everything))
    state = torch.load(everything, weights_only=False)
    marker = tmp_path / "payload-ran"
    # step 12: a pickle that runs a command, which DCP's own planner would unpickle
    state["dataloader"]["stream_00000"] = Payload(marker)
    dcp.save(state, checkpoint_id=str(run / "checkpoint" / "step-12"), no_dist=True)
    # step 16: a stream state pickled into bytes (an older mhar-titan's format), which only rank 0 reads
    state["dataloader"]["stream_00000"] = pickle.dumps(Payload(marker))
    dcp.save(state, checkpoint_id=str(run / "checkpoint" / "step-16"), no_dist=True)
    assert not marker.exists()

    dcp.load({"dataloader": {"stream_00000": ""}}, checkpoint_id=str(run / "checkpoint" / "step-12"), no_dist=True)
    assert marker.exists()  # the payload is real: DCP's default planner runs it
    marker.unlink()

    proc = torchrun(run, "--training.steps", "8", *SCHEDULE, *VALIDATE)
    log = proc.stdout + proc.stderr
    assert not marker.exists()
    assert "dataloader.stream_00000: not a JSON stream state (bytes" in log and "falling back to step 12" in log
    assert "'dataloader.stream_00000' is not plain data" in log and "falling back to step 8" in log
    assert "Training starts at step 9" in log
    assert "files have no recorded checksum" in log  # written by a tool, not by a run


def test_resume_with_another_architecture_is_refused_before_anything_is_rewritten(straight, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    recorded = {name: (run / name).read_bytes() for name in ("model_args.json", "fingerprint.json")}
    # one rank with the run's global batch (2 ranks x 4 windows): the refusal does not depend on the rank count
    args = ("--training.steps", "8", *SCHEDULE, *VALIDATE, "--training.global_batch_size", "8")

    proc = torchrun(run, *args, config="configs/tiny_cpu_mhar.toml", nproc=1, check=False)  # control run, MHAR job
    assert proc.returncode != 0
    assert "model.mhar.enable: false in the run, true now" in proc.stdout + proc.stderr

    # The other direction: an MHAR run (2 blocks, 8 heads; its fingerprint says so) resumed as the control
    fingerprint = json.loads(recorded["fingerprint.json"])
    fingerprint["model"]["mhar"] = {"enable": True, "num_heads": 8, "num_blocks": 2}
    (run / "fingerprint.json").write_text(json.dumps(fingerprint))
    proc = torchrun(run, *args, nproc=1, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "model.mhar.enable: true in the run, false now" in log
    assert "the architecture ([model], [mhar]) of a run cannot change" in log
    assert (run / "model_args.json").read_bytes() == recorded["model_args.json"]
    assert json.loads((run / "fingerprint.json").read_text()) == fingerprint
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["step-4", "step-8"]
    # (a deliberate schedule change, allowed: tests/test_cluster_run.py)


def launch_until(run: Path, pattern: str | None, action, *extra: str, env: dict | None = None) -> tuple[int, str]:
    """launch/torchrun.sh on 2 ranks; when a line contains `pattern`, call action(launcher pid)."""
    cmd = [str(REPO / "launch" / "torchrun.sh"), "--nproc", "2", "configs/tiny_cpu.toml"]
    cmd += ["--job.dump_folder", str(run), "--training.steps", "8", *SCHEDULE_EVERY_2, *VALIDATE, *extra]
    env = {**os.environ, "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
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

    # 3. The newest checkpoint is damaged: 4 low bits flipped in one byte of a shard, which DCP
    #    alone would load. Its checksum gives it away; the restart falls back and says so.
    shard = sorted((ckpt / f"step-{stop}").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x0F
    shard.write_bytes(bytes(data))
    previous = max(int(p.name[5:]) for p in ckpt.glob("step-*") if int(p.name[5:]) < stop)
    rc, log = launch_until(run, None, None)
    assert rc == 0, log[-3000:]
    assert f"DamagedCheckpoint: 1 damaged files: {shard}: xxh3_128" in log
    assert f"falling back to step {previous}" in log
    assert f"Training starts at step {previous + 1}" in log

    for tag in (LOSS_TAG, GRAD_NORM_TAG, "val/ce", "val/ce_ema", *SPIKE_SCORES):
        want, got = read_scalars(straight, tag), read_scalars(run, tag)
        assert got == want, f"{tag}: {got} != uninterrupted {want}"
    # TensorBoard's own reader: one run (one folder) across the four starts, each step once, the
    # steps the killed and the damaged timelines logged past their resume point purged
    assert {p.parent for p in run.rglob("events.out.tfevents.*")} == {run / "tb"}
    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    steps = [e.step for e in events.Scalars(LOSS_TAG)]
    assert steps == list(range(1, 9)), steps
    assert [e.value for e in events.Scalars(LOSS_TAG)] == [read_scalars(straight, LOSS_TAG)[s] for s in steps]


def _flat(tree: dict, prefix: str = "") -> dict:
    return {
        k: v
        for key, value in tree.items()
        for k, v in (_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value}).items()
    }


def _everything(step_dir: Path, out: Path) -> dict:
    dcp_to_torch_save(str(step_dir), str(out))
    return _flat(torch.load(out, weights_only=False))


def signal_every_process_once_held(run: Path, launcher: int) -> None:
    """SIGTERM to every process of the job, one by one, as Slurm's scancel, requeue, time limit and preemption send
    it (the launcher, torchrun, the workers, torch's checkpoint processes), once both ranks hold step 4's save."""
    deadline = time.monotonic() + 120
    while len(list((run / "checkpoint").glob("step-4.signal-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    for pid in process_tree(launcher):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def test_a_stop_during_a_background_save_waits_for_it_and_resumes_to_the_same_losses(straight, tmp_path):
    run, asynchronous = tmp_path / "run", ("--training.steps", "8", *SCHEDULE_EVERY_2, *VALIDATE)
    ckpt = run / "checkpoint"
    # 1. Saves every 2 steps in torch's checkpoint process (async_with_pinned_mem: staged by a thread while the
    #    next step runs and validation swaps the EMA in). The save of step 4 is held before it writes a byte while
    #    every process of the job gets SIGTERM, as a cluster sends it (components/checkpoint/testing.py): torchrun
    #    and the checkpoint processes live through it, the stop after step 5 waits for step 4, then saves step 5.
    rc, log = launch_until(
        run,
        "held in the background; waiting for a SIGTERM",
        lambda pid: signal_every_process_once_held(run, pid),
        *("--checkpoint.async_mode", "async_with_pinned_mem"),
        env={HOLD_SAVE: "4:cluster"},
    )
    assert rc == 75, log[-3000:]
    # in the trainer's log: the stop found step 4 still being written and waited for it (the checkpoint process
    # logs its release on a stream of its own, not shown by launch/torchrun.sh)
    events = [
        "held in the background",
        "step 5/8",
        f"for the background save of {ckpt / 'step-4'}",
        f"{ckpt / 'step-5'}: written and checksummed",
    ]
    at = [log.find(e) for e in events]
    assert -1 not in at and at == sorted(at), dict(zip(events, at, strict=True))
    # the trainer's lines alone: torchrun passed the signal on and waited, nothing died of it
    assert "step-4 released, writing" in log
    assert "passed to the 2 workers" in log
    assert not any(s in log for s in ("death signal", "Traceback", "SignalException", "background process is dead"))
    assert json.loads((run / "preempted.json").read_text())["step"] == 5
    assert complete_steps(str(ckpt)) == [2, 4, 5] and not list(ckpt.glob("*.waiting-*"))
    for step in (2, 4, 5):  # each sealed by both ranks' checksums, and intact
        assert sorted(os.listdir(ckpt / f"step-{step}" / MANIFEST_DIR)) == ["rank-00000.json", "rank-00001.json"]
        assert verify_share(str(ckpt / f"step-{step}"), 0, 1) == ([], [])
    # the background save holds what the uninterrupted run's synchronous one holds, every tensor and value
    want = _everything(straight / "checkpoint" / "step-4", tmp_path / "want.pt")
    got = _everything(ckpt / "step-4", tmp_path / "got.pt")
    assert sorted(got) == sorted(want)
    differ = [k for k in want if not (torch.equal(got[k], want[k]) if torch.is_tensor(want[k]) else got[k] == want[k])]
    assert differ in ([], [f"train_state.{CLOCK_STATE}"])  # all but the compute clock's seconds, a measurement

    # 2. Requeued, saving in a background thread (async): the losses, validations and weights of the run that was
    #    never stopped, bit for bit.
    proc = torchrun(run, *asynchronous, "--checkpoint.async_mode", "async")
    assert "Training starts at step 6" in proc.stdout + proc.stderr
    for tag in (LOSS_TAG, GRAD_NORM_TAG, "val/ce", "val/ce_ema", *SPIKE_SCORES):
        want, got = read_scalars(straight, tag), read_scalars(run, tag)
        assert got == want, f"{tag}: {got} != uninterrupted {want}"
    assert complete_steps(str(ckpt)) == [5, 6, 8]  # keep_latest_k 3 (configs/tiny_cpu.toml)
    assert verify_share(str(ckpt / "step-6"), 0, 1) == ([], [])
    for ema in (False, True):
        want = load_run_checkpoint(str(straight), 8, ema=ema).state_dict()
        got = load_run_checkpoint(str(run), 8, ema=ema).state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want), f"ema={ema}: weights differ"


def test_clock_checkpoints_change_nothing_computed_and_a_crash_resumes_from_the_newest(straight, tmp_path):
    """[checkpoint] interval_minutes: a temporary checkpoint at every step between the interval's (every 2), written
    in the background. The job dies (SIGKILL) while step 6's save is held before it writes: it resumes from step 5's
    temporary checkpoint and logs every value of the run without any, and only regular checkpoints remain."""
    run, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoint"
    clock = ("--checkpoint.interval_minutes", "0.00001", "--checkpoint.async_mode", "async")  # due at every step

    def kill_once_held(pid: int) -> None:
        deadline = time.monotonic() + 120
        while len(list(ckpt.glob("step-6.signal-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        kill_everything(pid)

    launch_until(run, "held in the background", kill_once_held, *clock, env={HOLD_SAVE: "6:cluster"})
    assert 5 in complete_steps(str(ckpt)) and 6 not in complete_steps(str(ckpt))
    assert temporary_steps(str(ckpt)) >= {5}
    rc, log = launch_until(run, None, None, *clock)
    assert rc == 0, log[-3000:]
    assert "Training starts at step 6" in log
    for tag in (LOSS_TAG, GRAD_NORM_TAG, "val/ce", "val/ce_ema", *SPIKE_SCORES):
        want, got = read_scalars(straight, tag), read_scalars(run, tag)
        assert got == want, f"{tag}: {got} != uninterrupted {want}"
    assert complete_steps(str(ckpt)) == [4, 6, 8] and temporary_steps(str(ckpt)) == set()


def test_a_crashed_job_is_relaunched_from_its_checkpoint_and_the_same_crash_twice_is_not(straight, tmp_path):
    """launch/torchrun.sh after a crash (rank 1 raising after step 5, once): the ending recorded, the job relaunched
    at once ([job] restart_backoff_s 0) from step 4's checkpoint, ending with the uninterrupted run's values. A crash
    at the same step at every launch is restarted once, then not: exit 1, the line naming it."""
    run, no_wait = tmp_path / "run", ("--job.restart_backoff_s", "0")
    rc, log = launch_until(run, None, None, *no_wait, env={CRASH_ENV: "5:once"})
    assert rc == 0, log[-3000:]
    cause = f"RuntimeError: TEST CRASH ({CRASH_ENV}) after step 5"
    assert f"crashed (exit 1) at step 5, rank 1: {cause}: restart 1 of 3 in 0 s" in log
    assert "Training starts at step 5" in log
    for tag in (LOSS_TAG, GRAD_NORM_TAG, "val/ce", "val/ce_ema", *SPIKE_SCORES):
        want, got = read_scalars(straight, tag), read_scalars(run, tag)
        assert got == want, f"{tag}: {got} != uninterrupted {want}"
    ended = [(e["class"], e["step"], e["rank"], e["cause"]) for e in read_endings(str(run))]
    assert ended == [("crashed", 5, 1, cause), ("finished", 8, 0, "finished its steps")]
    assert read_scalars(run, RESTARTS_TAG) == {5: 1.0}  # in TensorBoard, at the restarted job's first step

    again = tmp_path / "again"
    rc, log = launch_until(again, None, None, *no_wait, env={CRASH_ENV: "3:always"})
    assert rc == 1
    assert f"crashed (exit 1) at step 3, rank 1: {cause[:-1]}3, twice in a row: not restarted" in log
    assert [(e["class"], e["step"]) for e in read_endings(str(again))] == [("crashed", 3), ("crashed", 3)]
