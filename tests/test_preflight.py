"""The preflight end to end on CPU ranks (the tiny pair: probe, base, both arms killed and resumed, exports,
lm-eval, report), a stage made to fail on purpose, the refusals a new user meets, and the verdicts' rules."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from mhar_titan.config import parse_config
from mhar_titan.preflight import cli
from mhar_titan.preflight.pair import PairSettings, moved_stages
from mhar_titan.preflight.resume import resume_check
from mhar_titan.preflight.verdicts import speed_memory_stage, start_stage

CONFIGS = [str(REPO / "configs" / "tiny_cpu.toml"), str(REPO / "configs" / "tiny_cpu_mhar.toml")]
ROW = re.compile(r"^([a-i])\. (.+?)\s+(PASS|FAIL)\s+(\d+)s\s+(.*)$", re.M)


def preflight(out: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mhar_titan.preflight", *CONFIGS, "--out", str(out), *args]
    run_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=run_env, timeout=900)


def rows(stdout: str) -> dict[str, tuple[str, str]]:
    return {m[1]: (m[3], m[5]) for m in ROW.finditer(stdout)}


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    out = tmp_path_factory.mktemp("preflight")
    # 8 steps an arm, the fewest the preflight takes (a checkpoint at 4, the kill after 6), the gate statistics every
    # 4 steps (the configs' 10 would log none before the end): the default's 40 run the same code, at 4x the time
    # on one rank: the preflight's 2-rank paths run in tests/test_preflight_probe.py (the probe's ranks) and
    # tests/test_preflight_verdicts.py (the pair's jobs killed and relaunched)
    args = ("--limit", "8", "--steps", "8", "--mhar.stats_freq", "4", "--nproc", "1")
    args += ("--checkpoints", str(out / "scratch"))
    done = preflight(out, *args)
    (report,) = out.glob("*/report.md")
    return done, report.parent


def test_the_whole_pipeline_passes_on_cpu_ranks(full):
    done, root = full
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = rows(done.stdout)
    assert sorted(table) == list("abcdefghi")
    assert all(result == "PASS" for result, _ in table.values()), table
    assert re.search(r"peak control [\d.]+ GiB \(rank 0\), mhar [\d.]+ GiB \(rank 0\)", table["e"][1])
    report = (root / "report.md").read_text()
    assert report.startswith(f"# Preflight {root.name}: PASS")
    assert "| d. pair: train, kill, resume | **PASS** |" in report
    assert "Evaluation (lm-evaluation-harness)" in (root / "pair" / "compare" / "report.md").read_text()


def test_the_mhar_arm_was_killed_and_resumed_as_a_user_would_see_it(full):
    done, root = full
    killed = (root / "logs" / "mhar-killed.log").read_text()
    resumed = (root / "logs" / "mhar-resumed.log").read_text()
    rerun = (root / "logs" / "mhar-rerun.log").read_text()  # the same steps again from the checkpoint, killed at 6
    assert "(step 4)" in rerun and "Training starts at step 5" in rerun and "validation at step 6:" in rerun
    assert "Training starts at step 1\n" in killed
    assert "resumes from its checkpoint" in resumed and "(step 4)" in resumed
    assert "Training starts at step 5" in resumed and "step 8/8" in resumed
    control = (root / "logs" / "control-uninterrupted.log").read_text()  # the default --kill mhar
    assert "Training starts at step 1\n" in control and "step 8/8" in control and "resumes" not in control
    assert "mhar steps 5-6 bitwise" in rows(done.stdout)["d"][1] and "control uninterrupted" in done.stdout
    for arm in ("control", "mhar"):
        assert not (root / "pair" / arm / "checkpoint").exists()  # scratch removed afterwards
        assert not (root.parent / "scratch" / f"{root.name}-{arm}").exists()  # --checkpoints: there, and removed
    assert (root.parent / "scratch").is_dir()
    assert not (root / "exports").exists() and not (root / "base").exists()


def test_a_perturbed_kernel_fails_its_stage_only_and_the_exit_code(tmp_path):
    """The kernel test seam (MHAR_PREFLIGHT_PERTURB_KERNEL) through the whole CLI: stage b fails naming the
    tensor and its bound, a and c pass, the exit code is 1 (tests/test_preflight_probe.py judges rank files)."""
    # one rank: the seam perturbs every rank's kernels alike
    done = preflight(tmp_path, "--stages", "abc", "--nproc", "1", env={"MHAR_PREFLIGHT_PERTURB_KERNEL": "1e-2"})
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    table = rows(done.stdout)
    assert (table["a"][0], table["b"][0], table["c"][0]) == ("PASS", "FAIL", "PASS"), table
    assert "2 sources: out_a error" in table["b"][1] and "x its bound" in table["b"][1]
    assert "FAIL (b)" in done.stdout
    (report,) = tmp_path.glob("*/report.md")
    section = report.read_text().split("## b. kernels: FAIL", 1)[1]
    assert "Test seam on: outputs perturbed by 0.01 x max|output|" in section.split("\n## ", 1)[0]


@pytest.mark.parametrize(
    "args,says",
    [
        (
            ["--model.hf_assets_path", "/nonexistent/marin-8b"],
            "--model.hf_assets_path /nonexistent/marin-8b: no such folder",
        ),
        (["--data.mixture", "web=1.0:/nonexistent/web/*.parquet"], "matches no parquet file; set [data] mixture"),
        (["--data.mixture", "web=1.0:/nonexistent/web"], "'/nonexistent/web' matches no parquet file; set [data]"),
        (["--gpu-memory", "1MiB"], "a GPU of 0.0 GiB is too small for the configs"),
    ],
    ids=["wrong-base-path", "data-matches-nothing", "data-folder-absent", "gpu-too-small"],
)
def test_bad_input_is_one_line_before_any_training(tmp_path, capsys, args, says):
    """The CLI's main in this process (the last test runs it as its own process, as a user does)."""
    with pytest.raises(SystemExit) as stop:
        cli.main([*CONFIGS, "--out", str(tmp_path), "--stages", "d", *args])
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m mhar_titan.preflight: ") and says in lines[0], err
    assert not list(tmp_path.glob("*/pair/*/checkpoint")) and not list(tmp_path.glob("*/logs/*-killed.log"))


def test_two_control_configs_are_not_a_pair_one_line_from_the_command(tmp_path):
    cmd = [sys.executable, "-m", "mhar_titan.preflight", CONFIGS[0], CONFIGS[0], "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "must have [mhar] enable = false" in lines[0], done.stderr


def test_a_resume_that_differs_is_named_by_step_and_tag():
    killed = {"train/loss": {20: 3.0, 21: 2.9, 22: 2.8}, "grad_norm": {21: 1.0, 22: 1.1}, "tokens_per_s": {21: 5.0}}
    resumed = {
        "train/loss": {20: 3.0, 21: 2.9, 22: 2.8000001},
        "grad_norm": {21: 1.0, 22: 1.1},
        "tokens_per_s": {21: 9.0},
    }
    check = resume_check(killed, resumed, checkpoint_at=20)
    assert check["steps"] == [21, 22] and not check["equal"]
    assert check["first_differing_step"] == 22 and check["differing_values"] == 1  # tokens/s is not compared
    assert check["differ"][0]["tag"] == "train/loss"
    assert resume_check(killed, killed, checkpoint_at=20)["equal"]


def test_the_start_is_judged_against_the_batch_noise():
    head = [{"control": 10.0, "mhar": 10.0 + 4e-5}]
    assert start_stage({"first_step_abs_delta": 4e-5, "noise": 0.05, "head": head}).ok
    assert not start_stage({"first_step_abs_delta": 0.01, "noise": 0.05, "head": head}).ok


def test_memory_beyond_the_plan_by_more_than_5_percent_fails():
    class S:
        checkpoint_at = 20

    def arm(peak):
        steady = {s: 1000.0 for s in range(1, 41)}
        return {
            "killed": {"scalars": {"tokens_per_s": steady, "memory/peak_active_gib": {5: peak}}},
            "resumed": {"scalars": {"memory/peak_active_gib": {30: peak - 1}}},
        }

    arms = {"control": arm(60.0), "mhar": arm(61.0)}
    assert speed_memory_stage(arms, {"control": 59.0, "mhar": 60.5}, S).ok
    stage = speed_memory_stage(arms, {"control": 59.0, "mhar": 57.0}, S)
    assert not stage.ok and "mhar peak 61.00 GiB (rank 0) is +7.0% off the plan" in stage.figure


def test_the_slurm_form_runs_the_preflight_on_the_nodes_gpus(tmp_path):
    env = {**os.environ, "PYTHON": "echo", "SLURM_GPUS_ON_NODE": "h100:8", "SLURM_SUBMIT_DIR": str(REPO)}
    done = subprocess.run(
        ["bash", "launch/preflight.sbatch", *CONFIGS, "--steps", "40"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.split() == ["-m", "mhar_titan.preflight", *CONFIGS, "--steps", "40", "--nproc", "8"]
    missing = subprocess.run(["bash", "launch/preflight.sbatch", CONFIGS[0]], cwd=REPO, capture_output=True, text=True)
    assert missing.returncode == 2 and "usage: sbatch" in missing.stderr


def test_the_configs_mixture_stages_move_between_the_checkpoint_and_the_kill():
    """A stage at step 121 of 150 would never be reached in 40 steps: it moves to step 26, after the step-20
    checkpoint and before the kill after step 30, so the killed job and its relaunch both cross it."""
    tiny = str(REPO / "configs" / "tiny_cpu.toml")
    s = PairSettings(40, 20, 30, 2, Path("pair"), Path("logs"), sys.executable)
    cfg = parse_config(["--job.config_file", tiny, "--data.mixture_stages", "121: docstrings=0.3 code=0.7"])
    assert moved_stages(cfg, s) == (
        ["--data.mixture_stages", "26: docstrings=0.3 code=0.7"],
        "mixture stages moved to this run's steps (121 -> 26)",
    )
    two = parse_config(
        ["--job.config_file", tiny, "--data.mixture_stages", "100: docstrings=1 code=1,121: docstrings=0 code=1"]
    )
    assert moved_stages(two, s)[0] == [
        "--data.mixture_stages",
        "24: docstrings=1.0 code=1.0,27: docstrings=0.0 code=1.0",
    ]
    assert moved_stages(parse_config(["--job.config_file", tiny]), s) == ([], "")
