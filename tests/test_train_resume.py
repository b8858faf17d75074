"""2-rank FSDP2 training through train_cpt.py on CPU, checkpoint, and exact resume."""

import torch
from conftest import torchrun

from mhar_titan.hf import load_run_checkpoint
from mhar_titan.tensorboard_scalars import LOSS_TAG, read_scalars

# A short schedule whose LR does not depend on how many steps each job runs.
SCHEDULE = ("--lr_scheduler.total_steps", "8", "--lr_scheduler.warmup_steps", "2", "--checkpoint.interval", "4")
VALIDATE = ("--validation.freq", "2", "--validation.steps", "2", "--ema.beta", "0.8")
GRAD_NORM_TAG = "grad_norm"


def test_resume_reproduces_uninterrupted_run(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"

    # Validates the raw and the EMA weights at steps 2, 4, 6, 8.
    proc = torchrun(straight, "--training.steps", "8", *SCHEDULE, *VALIDATE)
    log = proc.stdout + proc.stderr
    assert "Applied FSDP to the model" in log
    assert "training on CPU" in log and "with gloo" in log

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
