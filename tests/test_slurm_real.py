"""The launchers under a real Slurm (chaos/slurm.py: Debian's 22.05 daemons on this machine, its CPUs, no GPU): the
tiny pair through `launch/pair.sh --slurm`, run to its end; then the soak's short form (chaos/soak.py): the same
pair with every kind of fault at drawn moments (a rank SIGKILLed, SIGTERM to the job, a requeue, the time-limit
warning, a crash and a hang in both arms), each job run ending as its fault says, restarted within the budget,
losing no more work than the clock's checkpoints allow, and every value logged equal to the uninterrupted pair's.

Skipped without root or without the packages, failed instead where MHAR_REQUIRE_SLURM=1 (`.ci/run` sets it)."""

import os
import sys

import pytest

from chaos.schedule import EXTERNAL, INJECTED
from chaos.slurm import REQUIRE_ENV, SlurmCluster, unavailable
from chaos.soak import Settings, job_env, run_round, submit_pair, summary
from mhar_titan.components.tensorboard_scalars import LOSS_TAG, read_scalars

# The soak's short form: 16 steps an arm, a checkpoint every 4 and by the clock every 6 s, two external faults an arm
SETTINGS = Settings(steps=16, save_every=4, clock_minutes=0.1, external_per_arm=2)
SEED = 0  # its faults: both arms crash after step 6 and hang as step 8's validation begins (after its checkpoint);
# the control gets the warning and a SIGTERM (scancel), the MHAR arm a SIGKILL of rank 1 and a requeue


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
    """The tiny pair submitted by launch/pair.sh --slurm on CPU nodes, both arms run to their end, uninterrupted."""
    root = tmp_path_factory.mktemp("pair")
    jobs = submit_pair(cluster, "reference", root, root, SETTINGS.overrides(), job_env(sys.executable))
    ended = [cluster.wait(job) for job, _ in jobs.values()]
    texts = [log.read_text() if log.exists() else "(no log)" for _, log in jobs.values()]
    return root, root / "reference", ended, texts


def test_the_tiny_pair_runs_to_its_end_through_pair_sh_and_real_sbatch(pair):
    _, runs, ended, logs = pair
    for arm, fields, log in zip(("control", "mhar"), ended, logs, strict=True):
        assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "0"), log[-3000:]
        assert f"step {SETTINGS.steps}/{SETTINGS.steps}" in log and "Traceback" not in log
        assert sorted(read_scalars(runs / arm, LOSS_TAG)) == list(range(1, SETTINGS.steps + 1))
    assert read_scalars(runs / "control", LOSS_TAG) != read_scalars(runs / "mhar", LOSS_TAG)


def test_the_short_soak_every_fault_survived_with_the_uninterrupted_values(cluster, pair):
    """One round of `make soak` at a fixed seed: every check of chaos/verdict.py holds for both arms."""
    root, reference, _, _ = pair
    said = []
    result = run_round(cluster, root, "soak", reference, SETTINGS, SEED, sys.executable, say=said.append)
    lines, data = summary([result])
    assert result.problems == [], "\n".join(said + result.problems + lines)
    kinds = {f.kind for f in result.faults}
    assert kinds == set(EXTERNAL) | set(INJECTED), kinds  # the seed's round holds every kind
    outcomes = data["outcomes"]
    assert len(outcomes) == len(result.faults) + sum(f.arm is None for f in result.faults)  # injected: both arms
    assert {o["kind"] for o in outcomes} == kinds
    for o in outcomes:
        assert o["restart_s"] is not None and o["recover_s"] is not None, o
        assert o["lost_s"] <= o["allowed_s"], o
        assert (o["lost_steps"] == 0) == (o["ended"] == "preempted") or o["ended"] != "preempted", o
    assert all(v.values > 0 for v in result.verdicts.values())
