"""The recipe under 2-rank FSDP2 on CPU: EMA against the parameter history, skipped non-finite steps."""

import shutil

import pytest
import torch
from conftest import torchrun

from mhar_titan.components.tensorboard_scalars import read_scalars
from mhar_titan.hf.run import load_run_checkpoint

FAST = ("--validation.no-enable", "--metrics.log_freq", "1")


def weights(run, step, ema=False):
    model = load_run_checkpoint(str(run), step, ema=ema)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory):
    """Step 0 on disk: the weights a 2-rank job loads and starts its EMA from (made once, copied)."""
    run = tmp_path_factory.mktemp("seed") / "run"
    torchrun(run, "--checkpoint.create_seed_checkpoint", "--parallelism.data_parallel_shard_degree", "1", nproc=1)
    return run


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
def test_ema_follows_the_parameter_history_and_a_nan_step_is_skipped(tmp_path, implementation, seed_run):
    """foreach: the host reads the verdict before the update; fused: the optimizer skips the step on
    the device (found_inf) and the host reads the verdict after issuing it."""
    run, beta = tmp_path / "run", 0.7
    shutil.copytree(seed_run, run)
    proc = torchrun(
        run,
        *("--training.steps", "6", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0"),
        *("--ema.beta", str(beta), "--optimizer.implementation", implementation),
        *FAST,
        script="tests/faulty_trainer.py",
        env={"NAN_STEPS": "3"},
    )
    log = proc.stdout + proc.stderr
    assert "step 3: non-finite loss or gradient" in log and "rank 1: loss share nan" in log

    history = [weights(run, s) for s in range(7)]
    for n in history[2]:  # the skipped step left every weight as it was
        assert torch.equal(history[3][n], history[2][n]), n
    assert any(not torch.equal(history[4][n], history[3][n]) for n in history[3])
    assert read_scalars(run, "train/skipped_steps") == {1: 0, 2: 0, 3: 1, 4: 1, 5: 1, 6: 1}
    losses = read_scalars(run)
    assert all(torch.isfinite(torch.tensor(losses[s])) for s in (1, 2, 4, 5, 6)), losses

    ema = weights(run, 6, ema=True)
    for n, got in ema.items():
        want = history[0][n].double()
        for s in (1, 2, 4, 5, 6):  # applied steps only
            want = beta * want + (1 - beta) * history[s][n].double()
        scale = max(max(h[n].abs().max().item() for h in history), 1e-3)
        err = (got.double() - want).abs().max().item()
        assert err <= 6 * 4 * torch.finfo(torch.float32).eps * scale, f"{n}: {err}"


def test_too_many_bad_steps_in_a_row_stop_with_a_checkpoint_of_the_last_good_state(tmp_path):
    run = tmp_path / "run"
    proc = torchrun(
        run,
        *("--training.steps", "6", "--checkpoint.interval", "10", "--checkpoint.enable_first_step_checkpoint"),
        *("--training.max_bad_steps", "2"),
        *FAST,
        script="tests/faulty_trainer.py",
        env={"NAN_STEPS": "2,3"},
        check=False,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "ChildFailedError" in log  # a failure, not one of the trainer's codes: torchrun's
    assert "step 3: 2 non-finite steps in a row (training.max_bad_steps = 2)" in log
    good, stop = weights(run, 1), weights(run, 3)
    for n in good:
        assert torch.equal(stop[n], good[n]), n
    good_ema, stop_ema = weights(run, 1, ema=True), weights(run, 3, ema=True)
    for n in good_ema:
        assert torch.equal(stop_ema[n], good_ema[n]), n
