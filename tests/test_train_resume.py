"""2-rank FSDP2 training through train_cpt.py on CPU, checkpoint, and exact resume."""

from conftest import torchrun

from mhar_titan.tensorboard_scalars import LOSS_TAG, read_scalars

# A short schedule whose LR does not depend on how many steps each job runs.
SCHEDULE = ("--lr_scheduler.total_steps", "8", "--lr_scheduler.warmup_steps", "2", "--checkpoint.interval", "4")
GRAD_NORM_TAG = "grad_norm"


def test_resume_reproduces_uninterrupted_run(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"

    proc = torchrun(straight, "--training.steps", "8", *SCHEDULE)
    log = proc.stdout + proc.stderr
    assert "Applied FSDP to the model" in log
    assert "training on CPU" in log and "with gloo" in log

    # A job that stops after step 4 (time limit, preemption) and a second job that resumes it.
    torchrun(resumed, "--training.steps", "4", *SCHEDULE)
    assert (resumed / "checkpoint" / "step-4").is_dir()
    proc = torchrun(resumed, "--training.steps", "8", *SCHEDULE)
    log = proc.stdout + proc.stderr
    assert "Training starts at step 5" in log

    for tag in (LOSS_TAG, GRAD_NORM_TAG):
        want = read_scalars(straight, tag)
        got = read_scalars(resumed, tag)
        assert list(want) == list(range(1, 9)), tag
        assert got == want, f"{tag}: resumed {got} != uninterrupted {want}"

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
