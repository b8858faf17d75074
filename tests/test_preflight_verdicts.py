"""Stage d's resume verdict in both directions: a correct resume on a GPU whose kernels are not repeatable passes
(the H100 runs that failed by chance under the old attention probe), every injected fault fails naming its step,
and where the job repeats bit for bit any difference fails. The faults are injected for real on CPU ranks through
the test seam (MHAR_TEST_RESUME_FAULT) and judged as the preflight judges them."""

import json
import os
import subprocess
import sys
from itertools import permutations

import pytest
from conftest import REPO

from benchmarks import resume_spread
from mhar_titan.components.checkpoint import testing
from mhar_titan.preflight.resume import resume_check
from mhar_titan.preflight.verdicts import SPREAD_FACTOR, pair_stage, resume_verdict, spread_ratio

H100 = json.loads((REPO / "tests" / "data" / "h100_resume_runs.json").read_text())


def scalars(name: str) -> dict[str, dict[int, float]]:
    return {t: {int(k): v for k, v in vals.items()} for t, vals in H100["runs"][name].items()}


def losses(name: str = "killed") -> dict[int, float]:
    return {int(k): v for k, v in H100["losses"][name].items()}


def verdict(killed, resumed, rerun, loss):
    check = resume_check(killed, resumed, 20, rerun)
    return (*resume_verdict("mhar", check, loss), spread_ratio(check), check)


# -- recorded on one H100: the MHAR arm at the marin8b geometry (8 layers), steps 21-30 --------------------------


@pytest.mark.parametrize("resumed,rerun", list(permutations(["rerun1", "rerun2", "rerun3"], 2)))
def test_correct_resumes_that_are_not_bitwise_pass_on_the_h100(resumed, rerun):
    """Every clean relaunch differs from the uninterrupted job (the attention backward is not repeatable there; the
    old probe called the GPU bitwise in 3 of 30 tries and failed such runs), yet within the relaunches' own spread,
    with a margin: the measured ratios are 0.79-1.8 against the bound of 10."""
    ok, figure, details, ratio, check = verdict(scalars("killed"), scalars(resumed), scalars(rerun), losses())
    assert not check["equal"] and check["differing_values"] > 100  # not bitwise, as on the failed run of the issue
    assert ok, figure
    assert ratio < SPREAD_FACTOR / 5, ratio
    assert "within" in figure and "the rerun spread" in figure
    assert any("routing statistics" in d and "not judged" in d for d in details)


@pytest.mark.parametrize(
    "fault,step,tag", [("moments", 22, "grad_norm"), ("ema", 30, "val/ce_ema")], ids=["moments", "ema"]
)
def test_injected_faults_fail_on_the_h100_naming_the_step(fault, step, tag):
    """Each fault as the preflight would see it: two relaunches with the fault, the uninterrupted job without.
    Measured 1,510x (moments) and 340x (EMA) the relaunches' spread."""
    ok, figure, _, ratio, _ = verdict(scalars("killed"), scalars(f"{fault}-a"), scalars(f"{fault}-b"), losses())
    assert not ok
    assert ratio > 30 * SPREAD_FACTOR, ratio
    assert f"from step {step} ({tag})" in figure, figure


# -- the rule on constructed runs ---------------------------------------------------------------------------------


def run(noise: float, seed: int, lr_shift: float = 0.0, shift: float = 0.0) -> dict[str, dict[int, float]]:
    """A run's scalars over steps 1-30: a decaying loss, a gradient norm, an LR and a data counter, with a fixed
    pattern of differences of relative size `noise` from step 22 on (the first resumed step's forward is exact),
    and a relative `shift` of the loss and gradient norm from step 22 on (a fault that every relaunch shares)."""

    def wiggle(step: int, k: int) -> float:
        return noise * (((step * 7 + seed * 13 + k * 5) % 11) - 5) / 5 + shift if step > 21 else 0.0

    return {
        "train/loss": {s: (6.0 - 0.05 * s + 0.03 * (s % 3)) * (1 + wiggle(s, 0)) for s in range(1, 31)},
        "grad_norm": {s: (3.0 + 0.1 * (s % 4)) * (1 + wiggle(s, 1)) for s in range(1, 31)},
        "lr/decay": {s: 1e-4 * s + lr_shift for s in range(1, 31)},
        "data/docs": {s: 10.0 * s for s in range(1, 31)},
        "mhar_attn_gate/layer00": {30: 0.002 * (1 + 50 * wiggle(30, 2))},  # noisy: reported, not judged
    }


def test_a_gpu_that_repeats_the_job_bitwise_fails_any_difference():
    killed = run(0.0, 0)
    relaunch = run(0.0, 0)
    relaunch["train/loss"][25] = killed["train/loss"][25] * (1 + 2**-23)  # one ulp, in both relaunches
    ok, figure, _, _, check = verdict(killed, relaunch, relaunch, killed["train/loss"])
    assert check["rerun"]["relaunches_equal"] and not ok
    assert "step 25 (train/loss" in figure and "repeats exactly here" in figure


def test_a_difference_within_the_spread_passes_and_beyond_it_fails():
    killed = run(1e-5, 0)
    ok, figure, _, ratio, _ = verdict(killed, run(1e-5, 1), run(1e-5, 2), killed["train/loss"])
    assert ok and ratio < 3, (figure, ratio)
    shift = 3 * SPREAD_FACTOR * 1e-5  # both relaunches thirty times the noise away from the uninterrupted job
    faulty = run(1e-5, 1, shift=shift), run(1e-5, 2, shift=shift)
    ok, figure, _, ratio, _ = verdict(killed, *faulty, killed["train/loss"])
    assert not ok and ratio > SPREAD_FACTOR and "from step 22" in figure, (figure, ratio)


def test_counters_must_be_identical_whatever_the_spread():
    killed = run(1e-5, 0)
    ok, figure, _, _, _ = verdict(killed, run(1e-5, 1, lr_shift=1e-9), run(1e-5, 2), killed["train/loss"])
    assert not ok and "lr/decay differs from the killed job's at step 21" in figure


def test_a_loss_beyond_a_tenth_of_the_batch_noise_fails_even_within_the_spread():
    killed = run(0.05, 0)  # two relaunches as far apart as the resume: a spread that explains nothing
    ok, figure, _, _, _ = verdict(killed, run(0.05, 1), run(0.05, 2), killed["train/loss"])
    assert not ok and "of the batch noise" in figure


def test_a_tag_the_resumed_job_did_not_log_is_named():
    killed = run(1e-5, 0)
    resumed = {t: v for t, v in run(1e-5, 1).items() if t != "grad_norm"}
    ok, figure, _, _, _ = verdict(killed, resumed, run(1e-5, 2), killed["train/loss"])
    assert not ok and "the resumed job logged no grad_norm at step 21" in figure


def test_no_rerun_means_any_difference_fails():
    killed = run(1e-5, 0)
    check = resume_check(killed, run(1e-5, 1), 20)
    ok, figure, _ = resume_verdict("mhar", check, killed["train/loss"])
    assert not ok and "no rerun measured" in figure


def test_the_stage_names_the_arm_and_step_of_a_fault():
    killed = {**run(1e-5, 0), "val/ce": {0: 12.0, 30: 5.0}}
    faulty = {**run(1e-5, 1), "val/ce": {0: 12.0, 30: 5.0}}
    faulty["lr/decay"] = {s: 0.0 for s in range(21, 31)}

    class S:
        steps, checkpoint_at = 30, 20

    arms = {
        "mhar": {
            "resume": resume_check(killed, faulty, 20, faulty),
            "killed": {"scalars": killed, "killed_at": 30},
            "resumed": {"scalars": faulty},
            "gates": 0.002,
        }
    }
    stage = pair_stage(arms, S, "8 layers", 1.0)
    assert not stage.ok and stage.key == "d"
    assert stage.figure.startswith("mhar: the resumed job's lr/decay differs from the killed job's at step 21")


def test_one_relaunch_a_fault_is_refused_where_the_clean_relaunches_differ():
    killed = run(1e-5, 0)
    runs = {"killed": killed, "rerun1": run(1e-5, 1), "rerun2": run(1e-5, 2)}
    with pytest.raises(ValueError, match="rerun1 and rerun2 differ in .* values from step 22; here a fault needs two"):
        resume_spread.bitwise(runs, ["rerun1", "rerun2"], 20)
    resume_spread.bitwise({**runs, "rerun2": runs["rerun1"]}, ["rerun1", "rerun2"], 20)  # bitwise: allowed
    faulty = {**runs, "lr-a": run(1e-5, 1, lr_shift=1e-9)}
    row = resume_spread.judge(faulty, ["rerun1", "rerun2"], ["lr"], 20, "mhar")[-1]
    assert (row["resumed"], row["rerun"], row["passed"]) == ("lr-a", "lr-a", False), row


def test_the_seam_refuses_an_unknown_fault(monkeypatch):
    monkeypatch.setenv(testing.RESUME_FAULT_ENV, "optimiser")
    with pytest.raises(ValueError, match="MHAR_TEST_RESUME_FAULT='optimiser': one of data, moments, lr, ema"):
        testing.resume_fault()
    monkeypatch.delenv(testing.RESUME_FAULT_ENV)
    assert testing.resume_fault() is None


# -- the faults injected for real on 2 CPU ranks, judged as the preflight judges -------------------------------------


@pytest.fixture(scope="module")
def cpu_spread(tmp_path_factory):
    out = tmp_path_factory.mktemp("spread")
    configs = [str(REPO / "configs" / name) for name in ("tiny_cpu.toml", "tiny_cpu_mhar.toml")]
    # 8 steps, the fewest the preflight takes (checkpoint at 4, kill after 6): each fault shows by step 6; one
    # relaunch a fault, judged against itself, as CPU ranks repeat a job bit for bit (checked before the faults run)
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.resume_spread",
        *configs,
        "--reruns",
        "2",
        "--steps",
        "8",
        "--fault-relaunches",
        "1",
        "--out",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = out.glob("*/resume_spread.json")
    return json.loads(result.read_text()), result.parent


def test_on_cpu_ranks_clean_relaunches_are_bitwise_and_every_fault_fails(cpu_spread):
    result, root = cpu_spread
    rows = {(r["fault"] or "clean", r["resumed"]): r for r in result["verdicts"]}
    assert set(result["pairwise_rms"].values()) == {0.0}  # CPU ranks repeat the job bit for bit
    assert rows["clean", "rerun1"]["passed"] and rows["clean", "rerun1"]["equal"]
    says = {
        "moments": "at step 6 (",  # step 5's update used zeroed moments: the first values it changes are step 6's
        "ema": "at step 6 (val/ce_ema",  # the EMA shows only in its validation, at the kill step
        "data": "data/docs differs from the killed job's at step 5",
        "lr": "lr/decay differs from the killed job's at step 5",
    }
    for fault, text in says.items():
        row = rows[fault, f"{fault}-a"]
        assert not row["passed"] and text in row["figure"] and row["rerun"] == f"{fault}-a", row
        assert "repeats exactly here" in row["figure"] or "differs from the killed job's" in row["figure"], row
    logs = {p.name: p.read_text() for p in (root / "logs").glob("mhar-*.log")}
    assert all("TEST FAULT" in logs[f"mhar-{f}-a.log"] for f in says)
    assert not any("TEST FAULT" in text for name, text in logs.items() if "rerun" in name or "killed" in name)
