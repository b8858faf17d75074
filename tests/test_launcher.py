"""launch/torchrun.sh prints the exact command under --dry-run and refuses a missing config."""

import subprocess

from conftest import REPO

SCRIPT = str(REPO / "launch" / "torchrun.sh")


def test_dry_run_prints_the_torchrun_command():
    out = subprocess.run(
        [SCRIPT, "--dry-run", "--nproc", "3", "configs/tiny_cpu.toml", "--training.steps", "5"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out[1:3] == ["-m", "torch.distributed.run"]
    assert "--nproc-per-node=3" in out
    assert out[-5:] == [str(REPO / "train_cpt.py"), "--job.config_file", "configs/tiny_cpu.toml"] + [
        "--training.steps",
        "5",
    ]


def test_missing_config_is_refused_by_name():
    proc = subprocess.run([SCRIPT, "configs/nope.toml"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "configs/nope.toml" in proc.stderr
