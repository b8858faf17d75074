"""What a cluster run meets, through train_cpt.py and launch/torchrun.sh on 2 CPU ranks: two jobs on
one run folder, a preemption signal in the first seconds, a deliberate schedule change, a corpus
re-prepared in place, a run folder without its fingerprint, another rank count or batch layout,
retention at the last step, a disk too small, and train_cpt.py without torchrun. (A source read to its
end: tests/test_data_mixture.py.)"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO, process_tree, torchrun
from s3_server import SERVERS, s3_server

from mhar_titan.compare.pair import compare
from mhar_titan.components.lr_schedule import lr_factor
from mhar_titan.components.param_norms import norm_groups
from mhar_titan.components.tensorboard_scalars import norm_tag, read_scalars
from mhar_titan.hf.run import load_run_checkpoint

STEPS = ("--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2", "--validation.no-enable")
SCHEDULE = ("--lr_scheduler.total_steps", "12", "--lr_scheduler.warmup_steps", "2")
ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
ONE_RANK = ("--training.global_batch_size", "8")
CONFIG = "configs/tiny_cpu.toml"  # the base's 2 ranks x 4 windows, as 2 microbatches on 1 rank


def mixture(corpus: Path | str) -> tuple[str, ...]:
    return ("--data.mixture", f"docstrings=0.7:{corpus}/docstrings,code=0.3:{corpus}/code")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, Path]:
    """7 steps on 2 ranks, checkpoints every 2 steps and at the last, on a copy of the demo corpus: (run, corpus)."""
    root = tmp_path_factory.mktemp("base")
    corpus = root / "corpus"
    shutil.copytree(REPO / "assets" / "tiny" / "corpus", corpus / "docstrings")
    shutil.copytree(REPO / "assets" / "tiny" / "code", corpus / "code")
    run = root / "run"
    torchrun(run, "--training.steps", "7", *STEPS, *SCHEDULE, *mixture(corpus), "--norms.freq", "2")
    return run, corpus


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in load_run_checkpoint(str(run), step).named_parameters()}


def copy_run(base_run: Path, to: Path, drop: tuple[int, ...] = ()) -> Path:
    shutil.copytree(base_run, to)
    for step in drop:
        shutil.rmtree(to / "checkpoint" / f"step-{step}")
    return to


def streams(run: Path, step: int) -> dict:
    keys = {"dataloader": {f"stream_{s:05d}": "" for s in range(4)} | {"batches": 0}}
    dcp.load(keys, checkpoint_id=str(run / "checkpoint" / f"step-{step}"), no_dist=True)
    return {k: json.loads(v) for k, v in keys["dataloader"].items() if k.startswith("stream")}


def files(run: Path) -> dict[Path, tuple[bool, int]]:
    """Every path below `run`, with the modification time of the files (a folder's changes with its entries)."""
    return {p.relative_to(run): (p.is_dir(), 0 if p.is_dir() else p.stat().st_mtime_ns) for p in run.rglob("*")}


def test_the_last_steps_save_applies_retention(base):
    run, _ = base
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["step-6", "step-7"]  # step 4 purged at 7


def test_per_layer_norms_on_two_ranks_are_those_of_the_whole_model(base):
    """The norms summed over FSDP's shards of 2 ranks: the step-6 checkpoint's weights, group by group (float32 in
    TensorBoard: 1e-6), at step 1 and every 2 steps; the gradient and update norms there too."""
    run, _ = base
    model = load_run_checkpoint(str(run), 6)
    groups = norm_groups(model)
    squares: dict[str, float] = {}
    for p in model.parameters():
        squares[groups[id(p)]] = squares.get(groups[id(p)], 0.0) + float(p.detach().double().square().sum())
    assert {"embedding", "layer00", "final_norm", "output"} <= set(squares)
    for group, square in squares.items():
        logged = read_scalars(run, norm_tag("weight", group))
        assert sorted(logged) == [1, 2, 4, 6] and logged[6] == pytest.approx(math.sqrt(square), rel=1e-6), group
        assert all(v > 0 for v in read_scalars(run, norm_tag("grad", group)).values()), group
        updates = read_scalars(run, norm_tag("update", group))
        assert updates[1] == 0.0 and all(updates[s] > 0 for s in (2, 4, 6)), group  # the warmup's LR at step 1: 0


@pytest.mark.parametrize("server", SERVERS)
def test_a_run_on_s3_from_the_first_step_trains_as_the_run_on_local_files(base, tmp_path, server):
    """2 ranks, the mixture's sources, their held-out validation sets and a set of its own all on s3:// (a real
    S3 server, s3fs): the same losses and weights as the base run on local files, bit for bit."""
    run, corpus = base
    with s3_server(server) as fs:
        fs.mkdir("corpora")
        fs.put(f"{corpus}/", "corpora/moved/", recursive=True)
        sets = "docstrings:heldout=docstrings,code:heldout=code,files:s3://corpora/moved/code"
        args = ("--training.steps", "7", *STEPS[:-1], *SCHEDULE, *mixture("s3://corpora/moved"))
        on_s3 = tmp_path / "on_s3"
        torchrun(on_s3, *args, "--validation.freq", "7", "--data.validation_sets", sets)
    assert read_scalars(on_s3, "train/loss") == read_scalars(run, "train/loss")
    for tag in ("val/docstrings/ce", "val/code/ce", "val/files/ce"):
        assert list(read_scalars(on_s3, tag)) == [0, 7]  # before the first step, and at the last
    assert all(torch.equal(a, b) for a, b in zip(weights(on_s3, 7).values(), weights(run, 7).values(), strict=True))
    ours, theirs = (json.loads((r / "fingerprint.json").read_text())["data"] for r in (on_s3, run))
    assert ours["contents"] == theirs["contents"]  # the shards by their contents: where they lie is not recorded


@pytest.mark.parametrize("server", SERVERS)
def test_another_rank_count_continues_exactly_from_the_corpus_on_s3_and_another_local_batch_is_refused(
    base, tmp_path, server
):
    run, corpus = base
    # From step 6 (an odd multiple of 2: the loader's batch counter matters), on 1 rank with the same
    # global batch: 2 microbatches of 4 windows a step, the same windows of the same streams as 2 ranks took;
    # with the corpus moved to object storage (a real S3 server, s3fs): the same shards by their contents.
    with s3_server(server) as fs:
        fs.mkdir("corpora")
        fs.put(f"{corpus}/", "corpora/moved/", recursive=True)
        resumed = copy_run(run, tmp_path / "one_rank", drop=(7,))
        args = ("--training.steps", "7", *STEPS, *SCHEDULE, *mixture("s3://corpora/moved"))
        torchrun(resumed, *args, *ONE_RANK, nproc=1)
    assert streams(resumed, 7) == streams(run, 7)
    assert read_scalars(resumed, "tokens_seen")[7] == read_scalars(run, "tokens_seen")[7]
    recorded = json.loads((resumed / "fingerprint.json").read_text())
    assert recorded["data"] == json.loads((run / "fingerprint.json").read_text())["data"]  # contents included
    assert recorded["history"] == []  # no change of any group was needed, or allowed

    args = ("--training.steps", "7", *STEPS, *SCHEDULE, *mixture(corpus))
    other = copy_run(run, tmp_path / "wide", drop=(7,))
    proc = torchrun(other, *args, "--training.local_batch_size", "8", nproc=1, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "data.local_batch_size: 4 in the run, 8 now" in log
    assert "keep it and let training.global_batch_size set the gradient-accumulation steps" in log


def test_an_allowed_schedule_change_is_applied_from_the_first_resumed_step(base, tmp_path):
    run, corpus = base
    resumed = copy_run(run, tmp_path / "run", drop=(7,))
    changed = ("--optimizer.lr", "1e-3", "--optimizer.weight_decay", "0.1", "--lr_scheduler.warmup_steps", "10")
    args = ("--training.steps", "8", *STEPS, "--lr_scheduler.total_steps", "14", *mixture(corpus), *changed)
    proc = torchrun(resumed, *args, "--checkpoint.allow_changes", "schedule")
    log = proc.stdout + proc.stderr
    assert "The run resumes from its checkpoint" in log and "schedule.decay_end: 12 in the run, 14 now" in log
    assert "schedule.weight_decay: 0.05 in the run, 0.1 now" in log
    assert "optimizer group decay: peak lr 0.003 -> 0.001, weight_decay 0.05 -> 0.1, lr of step 7" in log
    factor = {
        s: lr_factor(s, warmup_steps=10, decay_start=10, decay_end=14, decay_type="linear", min_lr_factor=0.1)
        for s in (6, 7)
    }
    lr = read_scalars(resumed, "lr/decay")
    # as TensorBoard stores it (float32); not 3e-3 x the old warmup's factor
    assert (lr[7], lr[8]) == tuple(float(torch.tensor(1e-3 * factor[s], dtype=torch.float32)) for s in (6, 7))
    state = {"lr_scheduler": {"base_lrs": [0.0, 0.0]}}
    dcp.load(state, checkpoint_id=str(resumed / "checkpoint" / "step-8"), no_dist=True)
    assert state["lr_scheduler"]["base_lrs"] == [1e-3, 1e-3]
    start = json.loads((resumed / "starts.jsonl").read_text().splitlines()[-1])
    assert "schedule.lr: 0.003 in the run, 0.001 now" in start["changes"]
    history = json.loads((resumed / "fingerprint.json").read_text())["history"]  # kept in the fingerprint
    assert [(h["step"], h["changes"]) for h in history] == [(6, [c for c in start["changes"] if "schedule." in c])]
    # the fingerprint now holds the values trained with: the same settings resume without allow_changes
    torchrun(resumed, *args[:1], "9", *args[2:])
    assert json.loads((resumed / "fingerprint.json").read_text())["history"] == history


def test_a_change_applied_to_both_arms_at_one_step_keeps_the_pair_matched_and_one_arm_alone_does_not(base, tmp_path):
    """launch/pair.sh --load-step 6: both arms (here two copies of the base run) go back to step 6, past their step 7,
    with a schedule change; both fingerprints record it at step 6 and the report lists it. The same change in one arm
    only is named at the top of the report."""
    run, corpus = base
    pair = tmp_path / "P"
    for arm in ("control", "mhar"):
        copy_run(run, pair / arm)
    changed = ("--lr_scheduler.total_steps", "14", "--checkpoint.allow_changes", "schedule")
    args = ("--training.steps", "8", *STEPS, *mixture(corpus), "--lr_scheduler.warmup_steps", "2", *changed)
    cmd = [str(REPO / "launch" / "pair.sh"), "--nproc", "2", "--load-step", "6", "P", CONFIG, CONFIG, *args]
    env = {**os.environ, **ENV, "PYTHON": sys.executable, "RUNS_DIR": str(tmp_path)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "every arm resumes from its checkpoint of step 6" in proc.stderr
    histories = [json.loads((pair / arm / "fingerprint.json").read_text())["history"] for arm in ("control", "mhar")]
    assert [h["step"] for h in histories[0]] == [6] and histories[0][0]["changes"] == histories[1][0]["changes"]
    assert read_scalars(pair / "control", "train/loss")[8] == read_scalars(pair / "mhar", "train/loss")[8]
    result = compare(str(pair))
    assert result["checks"]["history"]["identical"] is True
    text = (pair / "compare" / "report.md").read_text()
    assert "| deliberate changes (`fingerprint.json` history) | the same in both arms (step 6: schedule." in text
    assert "rollbacks: control back to step 6 from 7, mhar back to step 6 from 7 |" in text  # from their step-7 end
    # the change in one arm only: the other's record without it
    record = json.loads((pair / "mhar" / "fingerprint.json").read_text())
    (pair / "mhar" / "fingerprint.json").write_text(json.dumps({**record, "history": []}))
    result = compare(str(pair))
    assert result["checks"]["history"]["identical"] is False
    text = (pair / "compare" / "report.md").read_text()
    assert "**WARNING: the arms' histories differ" in text and "step 6: control changed schedule." in text
    assert "mhar changed nothing" in text


def test_a_corpus_rewritten_in_place_is_refused_before_the_run_is_touched(base, tmp_path):
    run, corpus = base
    moved = tmp_path / "corpus"
    shutil.copytree(corpus, moved)  # a copy elsewhere is the same corpus ...
    shard = sorted((moved / "code").glob("*.parquet"))[1]
    table = pq.read_table(shard)
    pq.write_table(table.take(list(range(table.num_rows))[::-1]), shard)  # ... until a shard is rewritten
    subprocess.run([sys.executable, "-m", "data.index", str(moved / "code")], cwd=REPO, check=True, capture_output=True)
    resumed = copy_run(run, tmp_path / "run", drop=(7,))
    before = files(resumed)
    # one rank, the run's global batch: the refusal does not depend on the rank count (one process fewer)
    proc = torchrun(
        resumed, "--training.steps", "8", *STEPS, *SCHEDULE, *mixture(moved), *ONE_RANK, nproc=1, check=False
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert 'data.contents.code: "' in log and "data.contents.docstrings" not in log
    assert "the corpus was rewritten since the run recorded it" in log
    assert files(resumed) == before  # no stray tb/<timestamp>, no record, no lock left


def test_a_run_folder_without_its_fingerprint_needs_allow_changes_legacy(base, tmp_path):
    run, corpus = base
    resumed = copy_run(run, tmp_path / "run", drop=(7,))
    (resumed / "fingerprint.json").unlink()
    before = files(resumed)
    args = ("--training.steps", "7", *STEPS, *SCHEDULE, *mixture(corpus), *ONE_RANK)  # one rank: as on two
    proc = torchrun(resumed, *args, nproc=1, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "holds checkpoints (steps 6..6) but no fingerprint.json" in log
    assert "--checkpoint.allow_changes legacy" in log
    assert files(resumed) == before
    proc = torchrun(resumed, *args, "--checkpoint.allow_changes", "legacy", nproc=1)
    assert "Training starts at step 7" in proc.stdout + proc.stderr
    assert (resumed / "fingerprint.json").exists()


def launch(run: Path, *args: str, nproc: int = 2) -> subprocess.Popen:
    cmd = [
        *(str(REPO / "launch" / "torchrun.sh"), "--nproc", str(nproc)),
        *("configs/tiny_cpu.toml", "--job.dump_folder", str(run)),
    ]
    env = {**os.environ, "PYTHON": sys.executable, **ENV}
    return subprocess.Popen(
        [*cmd, *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def read_until(proc: subprocess.Popen, text: str, lines: list[str]) -> None:
    for line in proc.stdout:
        lines.append(line)
        if text in line:
            return
    pytest.fail(f"{text!r} never came:\n{''.join(lines)[-3000:]}")


def test_a_second_job_on_a_live_run_folder_is_refused_and_the_first_one_goes_on(base, tmp_path):
    run, corpus = base
    live = copy_run(run, tmp_path / "run")
    args = ("--training.steps", "200", *STEPS, *SCHEDULE, *mixture(corpus))  # stopped by a signal long before
    first = launch(live, *args, "--training.global_batch_size", "8", nproc=1)  # one rank: less CPU while it waits
    lines: list[str] = []
    try:
        read_until(first, "Training starts at step 8", lines)
        recorded = (live / "fingerprint.json").read_bytes()
        starts = (live / "starts.jsonl").read_text()
        second = torchrun(live, *args, "--optimizer.lr", "1e-3", "--checkpoint.allow_changes", "schedule", check=False)
        log = second.stdout + second.stderr
        assert second.returncode == 2, log[-3000:]  # refused: the trainer's code, through mhar_titan.launch
        assert f"ERROR - LockHeld: {live}/run.lock: the run folder is in use by another job (host" in log, log[-3000:]
        assert "Traceback" not in log and "ChildFailedError" not in log  # the trainer's line alone
        assert (live / "fingerprint.json").read_bytes() == recorded and (live / "starts.jsonl").read_text() == starts
        assert [p.name for p in (live / "tb").iterdir() if p.is_dir()] == []  # no second TensorBoard run
        os.kill(first.pid, signal.SIGTERM)
        rest = first.communicate(timeout=300)[0]
    finally:
        for pid in process_tree(first.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert first.returncode == 75, rest[-3000:]
    stop = json.loads((live / "preempted.json").read_text())["step"]
    assert (live / "checkpoint" / f"step-{stop}" / ".metadata").is_file()
    assert not (live / "run.lock").exists()


def test_a_preemption_signal_in_the_first_seconds_stops_after_one_step_with_a_checkpoint(base, tmp_path):
    run, corpus = base
    early = copy_run(run, tmp_path / "run")
    job = launch(early, "--training.steps", "40", *STEPS, *SCHEDULE, *mixture(corpus))
    time.sleep(1.5)
    os.kill(job.pid, signal.SIGTERM)
    log = job.communicate(timeout=300)[0]
    assert job.returncode == 75, log[-3000:]
    assert "a stop was asked before training started" in log
    assert json.loads((early / "preempted.json").read_text())["step"] == 8
    assert (early / "checkpoint" / "step-8" / ".metadata").is_file() and not (early / "STOP").exists()


def test_a_checkpoint_folder_too_small_for_one_checkpoint_is_refused_at_start(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], capture_output=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mount.stderr.decode().strip()}")
    try:
        proc = torchrun(small / "run", "--training.steps", "2", *STEPS, check=False)
    finally:
        subprocess.run(["umount", str(small)], check=True)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"checkpoint folder {small}/run/checkpoint: 0.00 GiB free, one checkpoint of this run takes about" in log
    assert "step 1/2" not in log


def test_train_cpt_without_torchrun_says_how_to_launch_it():
    proc = subprocess.run(
        [sys.executable, "train_cpt.py", "--job.config_file", "configs/tiny_cpu.toml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "train_cpt.py: run it under torchrun (it needs a process group): launch/torchrun.sh CONFIG [--section.key "
        "value ...], or torchrun --nproc-per-node=N train_cpt.py --job.config_file CONFIG"
    ]
